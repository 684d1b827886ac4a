"""bench/proc_cpu.py's CPU accounting on canned /proc stat lines (a `Stats` of the test's): a
process's figure is its session's, every live process in it summed, read twice and taken a
step; what holds on a shared host, where wall seconds do not (bench/standby_cost.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import proc_cpu


def stat(pid: int, name: str, session: int, utime: int, stime: int) -> str:
    """A /proc/PID/stat line: pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt
    majflt cmajflt utime stime cutime cstime ..."""
    return f"{pid} ({name}) S 1 {session} {session} 0 -1 0 10 0 0 0 {utime} {stime} 7 7 20 0 3 0 1"


class Canned:
    """`proc_cpu.Stats` over the test's lines, as /proc would list them now."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def __call__(self) -> Iterable[str]:
        return iter(self.lines)


def test_a_stat_line_gives_user_and_system_seconds_not_its_childrens() -> None:
    line = stat(4242, "py (worker) 1", 4242, 250, 50)  # a name with spaces and ')'
    assert proc_cpu.stat_seconds(line) == pytest.approx(300 / proc_cpu.TICK)


def test_a_sessions_figure_sums_its_live_processes_and_no_one_elses() -> None:
    tick = proc_cpu.TICK
    stats = Canned(
        [
            stat(100, "ip", 100, tick, 0),  # a launcher that forked: its child counts too
            stat(101, "python", 100, 3 * tick, tick),
            stat(200, "python", 200, 2 * tick, 0),
            stat(300, "other work", 300, 50 * tick, 0),  # a process of no session named
        ]
    )
    got = proc_cpu.session_seconds(stats, {"s0r0": 100, "trainer": 200, "gone": 400})
    assert got == pytest.approx({"s0r0": 5.0, "trainer": 2.0, "gone": 0.0})


def test_two_readings_give_each_process_its_seconds_a_step() -> None:
    tick = proc_cpu.TICK
    sessions = {"stage0": 10, "trainer": 20}
    before = proc_cpu.session_seconds(
        Canned([stat(10, "python", 10, 4 * tick, tick), stat(20, "python", 20, tick, 0)]),
        sessions,
    )
    after = proc_cpu.session_seconds(
        Canned([stat(10, "python", 10, 10 * tick, 3 * tick), stat(20, "python", 20, 3 * tick, 0)]),
        sessions,
    )
    assert proc_cpu.per_step(before, after, 4) == pytest.approx({"stage0": 2.0, "trainer": 0.5})
    assert proc_cpu.per_step({"a": 1.0}, {"a": 2.0, "b": 5.0}, 1) == {"a": 1.0}  # both only
    with pytest.raises(ValueError, match="at least 1"):
        proc_cpu.per_step(before, after, 0)


def test_this_machines_proc_reads_this_process() -> None:
    sid = os.getsid(0)
    got = proc_cpu.session_seconds(proc_cpu.LiveStats(), {"me": sid})
    assert got["me"] > 0
