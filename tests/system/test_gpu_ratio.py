"""The CPU ratio pass does what the device does (issue 63, item 7): `bench/gpu_ratio.py
--cpu-tiny` trains in bf16-mixed on 4 real `swarm stage-server` processes x 1 on one device,
handing tensors over between them as co-located servers do (shared memory here, CUDA IPC on a
GPU), and a run that stops committing steps is stopped at its stall bound with the trainer's
last errors, not at its timeout, leaving no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.device_check import STALL_S, Checked

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_ratio.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(500)]


def ratio(tmp_path: Path, *args: str, timeout: float) -> tuple[int, str]:
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("GPU_CHECK_FORKED", None)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-tiny", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done.returncode, done.stdout + done.stderr


def report(output: str) -> dict:
    return dict(json.loads(output.split("\nRESULT ", 1)[1].splitlines()[0]))


def left_running(work: str) -> list[str]:
    """Processes whose command line names the run's directory (its stage servers' --job)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if work in cmdline and state not in ("Z", "X"):
            found.append(f"{pid}: {cmdline}")
    return found


def work_dir(output: str) -> str:
    return output.split("logs in ", 1)[1].split()[0]


def test_the_cpu_pass_trains_bf16_mixed_on_real_stage_servers_through_the_handover(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    args = ("--shapes", "short", "--warmup", "1", "--steps", "2", "--out", str(out))
    code, output = ratio(tmp_path, *args, timeout=450)
    assert code == 0, output
    r = report(output)
    assert r["failures"] == [] and r["precision"] == "bf16-mixed", output
    rows = r["shapes"]["short"]["rows"]
    assert list(rows) == ["swarm", "microbatched-eager", "pass-eager"]  # swarm first
    swarm = rows["swarm"]
    assert len(swarm["losses"]) == 3 and swarm["loss_diff"] <= 1e-2  # bf16-mixed's tolerance
    assert swarm["handed"] > 0  # co-located servers handed tensors over, not on the wire
    assert swarm["evictions"] == [0] * 4  # 4 stage servers, each logged its count at INFO
    # where each timed step's time went, from every process's timeline (bench/timeline_report)
    steps = swarm["timeline"]["steps"]
    assert [r["step"] for r in steps] == [1, 2], swarm["timeline"]
    for r, seconds in zip(steps, swarm["seconds"][1:], strict=True):
        assert r["wall"] == pytest.approx(seconds, abs=0.01)  # the coordinator's own step
        assert r["busy"] > 0 and r["idle"] == pytest.approx(r["wall"] - r["busy"])
        assert min(r["fill"], r["gaps"], r["drain"], r["commit"]) >= 0
    assert "Where a swarm step's time went" in output
    trace = json.loads((out / "trace-short-swarm.json").read_text())  # kept for Perfetto
    assert len({e["pid"] for e in trace["traceEvents"] if e["name"].startswith("forward")}) == 4
    # each run's process group ended and checked before the next started
    for phase in rows:
        assert f"  short {phase}: exit 0 " in output and "left behind: no process" in output
    work = work_dir(output)
    logs = sorted(p.name for p in Path(work).glob("short-swarm-stage-*.log"))
    assert logs == [f"short-swarm-stage-{k}.log" for k in range(4)]
    # real `swarm stage-server` processes, at INFO: each printed its ready line and its stop
    for name in logs:
        text = (Path(work) / name).read_text()
        assert "swarm stage-server ready:" in text and " INFO " in text
    assert not left_running(work)


def test_a_pass_that_stops_committing_steps_stops_at_its_stall_bound_naming_why(
    failed_smoke: Checked,
) -> None:
    """Every stage server dies in step 1's backward (SWARM_FAULTS): the trainer then retries
    without end (or gives up, naming why). The pass stops within its stall bound, far inside
    the phase's 600 s timeout, prints the stall and the trainer's last errors, and runs nothing
    after it; no process is left. Read from the device check's failed smoke part (its command
    is `--cpu-tiny --smoke --shapes short,long --stall-s 10`; tests/system/test_gpu_check.py
    reads how the check stops there)."""
    output = failed_smoke.log("smoke")
    assert "\nFAIL short swarm: " in output, output  # what makes its exit status 1
    r = report(output)
    assert r["failures"], output
    short = r["shapes"]["short"]["rows"]["swarm"]
    error = short["error"]
    # the trainer stalled after step 0 or gave up by itself: either way it is said, with why
    stalled = f"stalled: no committed step in {STALL_S} s after step 0"
    assert stalled in error or "exit " in error, error
    assert "the trainer's last errors:" in error and "failed" in error, error
    assert "short-swarm-stage-1.log: " in error and "backward@1" in error, error
    assert (
        r["shapes"]["long"]["rows"]["swarm"] == {"skipped": f"an earlier run {stalled}"}
        or "exit " in error
    )
    assert not left_running(work_dir(output))


def test_server_faults_are_each_stage_server_s_own() -> None:
    """`--server-faults`: `stageK:point@step` arms stage server K alone, `point@step` every one
    (the SWARM_FAULTS each is started with)."""
    from bench.gpu_ratio import server_env
    from swarm.ops.faults import ENV

    faults = "stage1:backward@1,handover-refuse@0"
    assert server_env(faults, 1) == {ENV: "backward@1,handover-refuse@0"}
    assert server_env(faults, 0) == {ENV: "handover-refuse@0"}
    assert server_env("stage2:forward@3", 0) == {}
    assert server_env("", 3) == {}
