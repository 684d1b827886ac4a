"""The side-by-side benchmark (bench/gpu_ratio.py) in its CPU mode, as CI runs it, so that the
script a GPU host runs has not rotted: every run finishes, swarm's losses agree with the
single-process torch run's at every step, and the table is printed with its ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_the_ratio_bench_runs_on_a_cpu_and_swarm_agrees_with_torch(tmp_path: Path) -> None:
    bench = [sys.executable, str(ROOT / "bench" / "gpu_ratio.py"), "--cpu-tiny"]
    done = subprocess.run(
        [*bench, "--shapes", "short", "--warmup", "1", "--steps", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=380,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "| run | tokens/s | ratio | p50 s | p90 s |" in output
    for run in ("microbatched-eager", "pass-eager", "swarm"):
        assert f"| {run} | " in output, output
    report = json.loads(output.split("RESULT ", 1)[1].splitlines()[0])
    assert report["failures"] == [] and report["precision"] == "fp32"
    shape = report["shapes"]["short"]
    rows = shape["rows"]
    torch_losses, swarm = rows["microbatched-eager"]["losses"], rows["swarm"]
    assert len(swarm["losses"]) == len(torch_losses) == 3  # warm-up and timed steps
    assert swarm["loss_diff"] <= 1e-4  # the same microbatches, the same model, in fp32
    # the one-pass run trains on the same batch: its losses agree too
    for a, b in zip(rows["pass-eager"]["losses"], torch_losses, strict=True):
        assert abs(a - b) <= 1e-4 * abs(b)
    assert shape["baseline"] == {"(a)": "microbatched-eager", "(b)": "pass-eager"}
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and 0 < row["p50_s"] <= row["p90_s"]
        assert row["busy"] is None and row["mfu"] is None  # no NVML, no known peak on a CPU
    assert 0 < swarm["commit_share"] < 1
    assert swarm["evictions"] == [0] * 4  # every stage server logged its count as it stopped
    assert shape["swarm_over_a"] > 0 and shape["swarm_over_b"] > 0
