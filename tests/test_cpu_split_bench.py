"""bench/cpu_split.py's reading of the threads' CPU, on canned /proc stat lines and readings:
the figures issue 69's swarm/torch gap is split by (a process's compute thread, its event loop,
the rest)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import cpu_split


def test_a_stat_line_gives_user_and_system_seconds_whatever_the_name() -> None:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
    line = "4242 (py (worker) 1) R 1 1 1 0 -1 0 10 0 0 0 250 50 0 0 20 0 3 0 100"
    assert cpu_split.stat_seconds(line) == pytest.approx(300 / cpu_split.TICK)


def test_the_main_thread_is_the_loop_and_the_busiest_other_the_compute() -> None:
    before = {100: 1.0, 101: 10.0, 102: 0.5, 103: 0.2}
    # 103 ended between the readings (not seen); 104 started (counted from zero)
    after = {100: 1.4, 101: 18.0, 102: 0.6, 104: 0.1}
    s = cpu_split.split(before, after, pid=100, steps=4)
    assert (s.compute, s.loop, s.other) == pytest.approx((2.0, 0.1, 0.05))
    assert s.total == pytest.approx(2.15)


def test_a_process_of_one_thread_has_no_compute_thread() -> None:
    s = cpu_split.split({7: 1.0}, {7: 3.0}, pid=7, steps=2)
    assert (s.compute, s.loop, s.other) == (0.0, 1.0, 0.0)


def test_a_run_is_read_as_its_loops_its_rest_and_its_total() -> None:
    split = {
        "stage 0": [1.0, 0.04, 0.01],
        "stage 1": [1.2, 0.05, 0.02],
        "trainer": [0.003, 0.02, 0.001],  # the trainer's compute is rest: it holds no stage
    }
    got = cpu_split.figures(split)
    assert got == pytest.approx({"loops": 0.09, "rest": 0.144, "total": 2.344})


def test_alternated_runs_are_compared_pair_by_pair() -> None:
    base = [{"loops": 0.2, "rest": 0.4, "total": 4.0}, {"loops": 0.1, "rest": 0.2, "total": 2.0}]
    new = [{"loops": 0.1, "rest": 0.4, "total": 3.0}, {"loops": 0.1, "rest": 0.1, "total": 4.0}]
    got = cpu_split.compared(base, new)
    assert got["loops"]["pairs"] == pytest.approx([0.5, 1.0])
    assert got["rest"]["pairs"] == pytest.approx([1.0, 0.5])
    assert got["total"]["pairs"] == pytest.approx([0.75, 2.0])
    assert (got["total"]["base"], got["total"]["new"]) == pytest.approx((3.0, 3.5))  # medians
