"""Benches leave nothing behind (issue 63, item 8): a bench/gpu_ratio.py phase or a
bench/gpu_check.py part that hangs past its timeout is ended with every process it started,
grandchildren too, and says so before the next one starts; the device's memory is waited for
until it is back where it was, for a bounded time (`bench.process_groups.settle`)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import gpu_check, gpu_ratio, process_groups  # noqa: E402

# A run that hangs: it starts a grandchild (in a process group of its own with `own_group`, as
# gpu_ratio's phases are inside a check's part), writes the grandchild's pid, and sleeps.
HANG = """
import os, subprocess, sys, time
own_group = sys.argv[1] == "own-group" if len(sys.argv) > 1 else False
child = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(600)"], process_group=0 if own_group else None
)
with open(os.environ["PIDFILE"], "w") as f:
    f.write(str(child.pid))
print("started", child.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    """A process that still runs (a zombie waiting for its reaper does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def grandchild(pidfile: Path) -> int:
    deadline = time.monotonic() + 60
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline, "the hanging run never started its grandchild"
        time.sleep(0.1)
    return int(pidfile.read_text())


def kill_if_left(pidfile: Path) -> None:
    """What the old code left running: ended here, so a failing test leaves nothing either."""
    if pidfile.exists() and pidfile.read_text():
        pid = int(pidfile.read_text())
        if alive(pid):
            import os
            import signal

            os.kill(pid, signal.SIGKILL)


def test_a_ratio_phase_that_hangs_is_ended_with_its_grandchild_at_its_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b8f54b2's `subprocess.run(timeout=)` killed the phase and left the servers it started."""
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    pidfile = tmp_path / "grandchild.pid"
    monkeypatch.setenv("PIDFILE", str(pidfile))
    monkeypatch.setattr(gpu_ratio, "__file__", str(script))  # the phase's command runs it
    monkeypatch.setattr(gpu_ratio, "PHASE_TIMEOUT_S", 3.0)
    args = argparse.Namespace(
        device="cpu",
        precision="fp32",
        warmup=1,
        steps=1,
        cpu_tiny=True,
        server_faults="",
        smoke=False,
        stall_s=0.0,
        py_spy=False,  # the phase's own option since the timeline (`--py-spy`)
    )
    try:
        r = gpu_ratio.run_phase(args, "microbatched-eager", "short", tmp_path)
        pid = grandchild(pidfile)
        assert "error" in r
        assert not alive(pid), f"the phase's grandchild {pid} outlived its timeout"
    finally:
        kill_if_left(pidfile)


def test_a_check_part_that_hangs_is_ended_with_every_group_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """b8f54b2 ended a part's process group: a grandchild in a group of its own (a gpu_ratio
    phase) lived on. Now the part's whole session ends, and the part says what it left."""
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    pidfile = tmp_path / "grandchild.pid"
    monkeypatch.setenv("PIDFILE", str(pidfile))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("OUT", raising=False)
    args = argparse.Namespace(
        device="cpu", quick=False, parts={"environment"}, ratio_shapes="short", smoke_stall_s=0.0
    )
    check = gpu_check.Check(args)
    part = gpu_check.Part(
        "hang", 3, lambda: [sys.executable, str(script), "own-group"], lambda c, o: (True, o)
    )
    try:
        check.run_part(part, time.monotonic() + 120)
        pid = grandchild(pidfile)
        assert part.status == "FAIL"
        assert not alive(pid), f"the part's grandchild {pid} outlived its timeout"
        assert "timed out after 3 s" in part.figures, part.figures
        assert "left behind: no process" in part.figures, part.figures
        assert "hang: left behind: no process" in capsys.readouterr().out
    finally:
        kill_if_left(pidfile)


def test_a_part_that_exits_leaving_a_process_running_has_it_ended_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leader that exits by itself with a server still running: the server is ended and
    counted, before the next part."""
    pidfile = tmp_path / "grandchild.pid"
    monkeypatch.setenv("PIDFILE", str(pidfile))
    leaves = HANG.rsplit("time.sleep(600)", 1)[0]  # it exits once its child runs
    script = tmp_path / "leaves.py"
    script.write_text(leaves)
    try:
        with open(tmp_path / "out.log", "w") as out:
            ended = process_groups.run(
                [sys.executable, str(script)],
                out=out,
                timeout=60,
                kind=process_groups.Kind.SESSION,
            )
        pid = grandchild(pidfile)
        assert ended.code == 0 and not ended.stopped and ended.stray == 1 and not ended.left
        assert not alive(pid)
        settled, line = process_groups.settle(ended, None, lambda: None)
        assert settled and line == "left behind: processes it left running: 1 (ended)"
    finally:
        kill_if_left(pidfile)


def test_the_next_part_waits_for_the_device_memory_and_says_where_it_is() -> None:
    """The reading is a seam (nvidia-smi on a GPU host): memory that comes back within the
    bound lets the next part start; memory that does not is said, with its figures."""
    ended = process_groups.Ended(code=0, why="", stray=0, left=(), seconds=1.0)
    readings = iter([9000, 6000, 1100])
    settled, line = process_groups.settle(ended, 1000, lambda: next(readings), bound=30)
    assert (
        settled and line == "left behind: no process; device memory back to 1100 MiB (1000 before)"
    )

    settled, line = process_groups.settle(ended, 1000, lambda: 9000, bound=0.5)
    assert not settled and "device memory 9000 MiB after" in line
    assert "not back to 1000 MiB (+256)" in line

    settled, line = process_groups.settle(ended, 1000, lambda: None)
    assert not settled and "device memory unread (was 1000 MiB)" in line

    stuck = process_groups.Ended(code=-9, why="timed out", stray=0, left=(41, 42), seconds=1.0)
    settled, line = process_groups.settle(stuck, None, lambda: None)
    assert not settled and line == "left behind: processes 41, 42 would not end"
