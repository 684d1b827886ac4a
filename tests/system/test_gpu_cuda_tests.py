"""The device check's "CUDA tests" are the tests that need CUDA (issue 63, item 6): picked by
their skip reason or a CUDA `torch.device` parameter (bench/gpu_cuda_tests.py), not by the word
"cuda" in their name or file. On this machine (no GPU) every test it keeps is one that skips."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.device_check import Checked

ROOT = Path(__file__).resolve().parents[2]

PICKED = """
import pytest
import torch

needs = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs
def test_marked():
    pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_marked_in_other_words():
    pass


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=needs)])
def test_a_parameter_with_the_mark(device):
    pass


@pytest.mark.parametrize("device", [torch.device("cpu"), torch.device("cuda", 0)])
def test_a_torch_device_parameter(device):
    pass


@pytest.mark.parametrize("device", ["cuda", "CUDA:1"])
def test_cuda_names_as_data(device):
    assert device.lower().startswith("cuda")


def test_cuda_handle_parsing_on_a_cpu():
    pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="where torch has a GPU, it trains")
def test_only_where_there_is_no_gpu():
    pass
"""

MODULE_MARKED = """
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_in_a_module_that_needs_cuda():
    pass
"""


def picked(tmp_path: Path, *targets: str, cwd: Path) -> dict[str, str]:
    """The outcomes bench/gpu_cuda_tests.py writes for `targets`, run here."""
    out = tmp_path / "tests.json"
    plugin = ["-p", "bench.gpu_cuda_tests", "--continue-on-collection-errors"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, *targets],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT), "GPU_CHECK_TESTS_JSON": str(out)},
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode in (0, 5), done.stdout + done.stderr
    return dict(json.loads(out.read_text()))


def test_tests_are_picked_by_their_skip_reason_or_a_cuda_device_parameter(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the project's settings
    (tmp_path / "test_picked.py").write_text(PICKED)
    (tmp_path / "test_module_marked.py").write_text(MODULE_MARKED)
    (tmp_path / "notes.py").write_text("")
    outcomes = picked(tmp_path, "test_picked.py", "test_module_marked.py", cwd=tmp_path)
    assert sorted(outcomes) == [
        "test_module_marked.py::test_in_a_module_that_needs_cuda",
        "test_picked.py::test_a_parameter_with_the_mark[cuda:0]",
        "test_picked.py::test_a_torch_device_parameter[device1]",
        "test_picked.py::test_marked",
        "test_picked.py::test_marked_in_other_words",
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="where torch has a GPU they run")
def test_every_test_the_check_picks_from_the_suite_skips_without_a_gpu(
    quick_check: Checked,
) -> None:
    """The whole suite, as the check runs it (its quick run's "CUDA tests" part, which collected
    the suite with bench/gpu_cuda_tests.py): what it keeps needs CUDA, so here (no GPU) each
    one skips; the CUDA handover's tests are among them, and the CPU tests of CUDA names (the
    deterministic switch's "CUDA:1") are not."""
    outcomes = quick_check.cuda_tests()
    assert outcomes and set(outcomes.values()) == {"skipped"}, outcomes
    handover = "tests/swarm/device/test_cuda_handover.py::"
    assert sum(name.startswith(handover) for name in outcomes) >= 2, sorted(outcomes)
    assert not [name for name in outcomes if "test_kernels.py" in name], sorted(outcomes)
