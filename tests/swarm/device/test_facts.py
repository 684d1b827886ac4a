"""`--device` checked against the machine (`swarm.device.facts`), on made-up machines: a clear
error that lists the devices there are and says what to do, the torch build's kernels against the
GPU's architecture (the RTX 50-series "no kernel image" case), the chosen GPU made the current
one; and for real on this machine, a stage server asked for a GPU it does not have."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stage_server.doctor import preflight
from swarm.device.facts import (
    apply_matmul_precision,
    missing_kernels,
    peak_line,
    peak_memory,
    read_peak,
    resolve_device,
)
from swarm.errors import SwarmError
from tests.support.devices import FakeFacts, Gpu
from tests.support.jobs import write_job

H100, RTX5090 = Gpu(), Gpu("NVIDIA GeForce RTX 5090", (12, 0))


def test_cpu_only_build_names_the_install_fix() -> None:
    with pytest.raises(SwarmError) as e:
        resolve_device("cuda:0", FakeFacts(cuda=None))
    assert "CPU-only build" in str(e.value)
    assert "install a CUDA build of torch" in str(e.value)
    assert "this machine has: cpu" in str(e.value)


def test_cuda_build_without_a_gpu_points_at_the_driver() -> None:
    with pytest.raises(SwarmError, match=r"sees no GPU: check the NVIDIA driver"):
        resolve_device("cuda:0", FakeFacts(gpus=[]))


def test_an_index_past_the_gpus_lists_them() -> None:
    facts = FakeFacts(gpus=[H100, Gpu("NVIDIA A100-SXM4-80GB", (8, 0))])
    with pytest.raises(SwarmError) as e:
        resolve_device("cuda:2", facts)
    message = str(e.value)
    assert "no such GPU; this machine has 2" in message
    assert "cuda:0 (NVIDIA H100 80GB HBM3)" in message
    assert "cuda:1 (NVIDIA A100-SXM4-80GB)" in message
    assert resolve_device("cuda:1", facts) == torch.device("cuda", 1)


def test_cuda_without_an_index_is_cuda_0_and_becomes_current() -> None:
    facts = FakeFacts(gpus=[H100, H100])
    assert preflight("cuda:1", facts) == torch.device("cuda", 1)
    assert preflight("cuda", facts) == torch.device("cuda", 0)
    assert preflight("cpu", facts) == torch.device("cpu")
    assert facts.selected == [1, 0], "set_device for each GPU chosen, none for the CPU"


def test_not_a_device() -> None:
    with pytest.raises(SwarmError, match=r"'gpu0' is not a device torch knows"):
        resolve_device("gpu0", FakeFacts(gpus=[H100]))


def test_rtx_50_series_under_a_torch_built_before_it() -> None:
    facts = FakeFacts(gpus=[RTX5090], arches=["sm_50", "sm_80", "sm_86", "sm_90"])
    with pytest.raises(SwarmError) as e:
        resolve_device("cuda:0", facts)
    message = str(e.value)
    assert "no kernels for NVIDIA GeForce RTX 5090 (sm_120)" in message
    assert "CUDA >= 12.8" in message
    assert "TORCH_INDEX=https://download.pytorch.org/whl/cu128" in message


@pytest.mark.parametrize(
    ("capability", "arches", "runs"),
    [
        ((9, 0), ["sm_80", "sm_90"], True),
        ((8, 6), ["sm_80"], True),  # a binary runs on later minors of its major
        ((8, 0), ["sm_86"], False),  # not on earlier ones
        ((12, 0), ["sm_90", "compute_90"], True),  # the driver compiles PTX for newer GPUs
        ((12, 0), ["sm_90a", "sm_100"], False),
        ((7, 5), ["sm_80", "compute_80"], False),  # PTX does not run on older GPUs
    ],
)
def test_kernels_for_an_architecture(
    capability: tuple[int, int], arches: list[str], runs: bool
) -> None:
    facts = FakeFacts(gpus=[Gpu(capability=capability)], arches=arches)
    assert (missing_kernels(facts, 0) is None) == runs


def test_the_peak_memory_line_reads_back() -> None:
    """What a stage server logs as it stops on a GPU is what the benchmarks read."""
    log = "ready\n" + peak_line("cuda:1", 123456789, 234567890) + "\nbye\n"
    assert read_peak(log) == 123456789
    assert read_peak("no such line") is None
    assert peak_memory(torch.device("cpu")) is None


def _tf32() -> object:
    """torch's float32 matmul setting, by whichever API this torch has."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        return matmul.fp32_precision == "tf32"
    return matmul.allow_tf32


def test_tf32_changes_nothing_on_a_cpu() -> None:
    before = _tf32()
    apply_matmul_precision(True, "cpu")
    assert _tf32() == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tf32_on_cuda_is_the_jobs_choice() -> None:
    apply_matmul_precision(True, "cuda:0")
    assert _tf32() is True
    apply_matmul_precision(False, "cuda:0")
    assert _tf32() is False


# (Its reason names no GPU API: bench/gpu_cuda_tests.py runs the tests whose skip names it.)
@pytest.mark.skipif(torch.cuda.is_available(), reason="where torch has a GPU, the server starts")
@pytest.mark.timeout(120)
def test_stage_server_asked_for_a_gpu_this_machine_lacks(tmp_path: Path) -> None:
    """A real stage server on this CPU-only machine: it stops at once, naming the fix."""
    job = write_job(tmp_path, training={"stages": 2})
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "swarm.cli",
            "stage-server",
            "--job",
            str(job),
            "--stage",
            "0",
            "--device",
            "cuda:0",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 2, done.stderr
    assert "--device cuda:0: CUDA is not available" in done.stderr
    if torch.version.cuda is None:  # this machine's (CI's) CPU build
        assert "CPU-only build: install a CUDA build of torch" in done.stderr
    else:  # a CUDA build on a machine without a GPU (the suite under a GPU image's torch)
        assert "sees no GPU: check the NVIDIA driver" in done.stderr
    assert "this machine has: cpu" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="where torch has a GPU, it trains")
@pytest.mark.timeout(120)
def test_swarm_local_asked_for_a_gpu_this_machine_lacks(tmp_path: Path) -> None:
    """The reference checks its device as a stage server does."""
    job = write_job(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "swarm.cli", "local", str(job), "--device", "cuda:0"],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 2, done.stderr
    assert "swarm local: error: --device cuda:0: CUDA is not available" in done.stderr
    assert "this machine has: cpu" in done.stderr
