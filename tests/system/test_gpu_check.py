"""The device check (bench/gpu_check.sh) on this machine's CPU, as CI runs it, so that the script
a GPU host runs has not rotted: every part passes, with its figures, and the summary lands in
$OUT."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_the_device_check_runs_green_on_a_cpu(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "OUT": str(tmp_path / "out"),
        "GPU_CHECK_WHEELS": "",
        "TMPDIR": str(tmp_path),
    }
    done = subprocess.run(
        [str(ROOT / "bench" / "gpu_check.sh"), "--device", "cpu", "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=380,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    summary = (tmp_path / "out" / "gpu_check.txt").read_text()
    assert "7 of 7 parts passed" in summary, summary
    for part in (
        "environment",
        "doctor",
        "CUDA tests",
        "train fp32",
        "train bf16-mixed",
        "llama-1b",
        "gpu ratio",
    ):
        assert f"PASS    {part} (" in summary, summary
    # the tests that need CUDA: skipped here (no GPU asked), none failed
    assert re.search(r"CUDA tests \(\d+ s\): (\d+ passed, )?\d+ skipped \(no GPU", summary), summary
    assert "against the CPU reference: loss" in summary and "tokens/s" in summary
    # each stage's replicas downloaded after training: bitwise equal (the claim GPU hosts check)
    assert summary.count("replicas of each stage bitwise equal: yes") == 2, summary
    assert "swarm against torch on the same device" in summary and "| swarm | " in summary
    assert (tmp_path / "out" / "gpu_check_logs" / "train-fp32.log").exists()


def test_a_device_that_is_not_one_is_refused_at_once(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_WHEELS": ""}
    done = subprocess.run(
        [str(ROOT / "bench" / "gpu_check.sh"), "--device", "tpu:0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--device 'tpu:0': cpu or cuda:N" in done.stderr
