"""CPU seconds of a bench's processes, read from /proc: what each spent between two readings,
a step. Unlike wall seconds, a figure that holds on a shared host: a process waiting for a
core spends none (bench/cpu_split.py, bench/wan.py, bench/standby_cost.py).

A process's figure is its session's (every bench process starts in a session of its own, its
pid the session's id): the user and system seconds (utime + stime of /proc/PID/stat, every
thread's, ended ones included) of each live process in it, so a launcher that forks (`ip netns
exec` in batch mode) still counts what it runs. A process that ends between the readings takes
its seconds with it; the benches read while their processes run.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol

__all__ = ["TICK", "LiveStats", "Stats", "per_step", "session_seconds", "stat_seconds"]

TICK = os.sysconf("SC_CLK_TCK")


def _fields(stat: str) -> list[str]:
    """The fields after a /proc/.../stat line's name (which may hold spaces and ')'): state,
    ppid, pgrp, session, ..."""
    return stat[stat.rindex(")") + 2 :].split()


def stat_seconds(stat: str) -> float:
    """utime + stime of a /proc/.../stat line, in seconds."""
    fields = _fields(stat)
    return (int(fields[11]) + int(fields[12])) / TICK


class Stats(Protocol):
    """Every live process's /proc/PID/stat line (`LiveStats`; the tests give canned ones)."""

    def __call__(self) -> Iterable[str]: ...


class LiveStats:
    """This machine's /proc."""

    def __call__(self) -> Iterable[str]:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                yield Path(f"/proc/{entry}/stat").read_text()
            except (FileNotFoundError, ProcessLookupError):  # ended since the listing
                continue


def session_seconds(stats: Stats, sessions: Mapping[str, int]) -> dict[str, float]:
    """Each named session's CPU seconds so far (`sessions`: name -> session id): the sum over
    its live processes. A session with none left reads 0."""
    names: dict[int, list[str]] = {}
    for name, sid in sessions.items():
        names.setdefault(sid, []).append(name)
    out = dict.fromkeys(sessions, 0.0)
    for line in stats():
        sid = int(_fields(line)[3])
        for name in names.get(sid, ()):
            out[name] += stat_seconds(line)
    return out


def per_step(
    before: Mapping[str, float], after: Mapping[str, float], steps: int
) -> dict[str, float]:
    """What each process named in both readings spent between them, a step."""
    if steps < 1:
        raise ValueError(f"{steps} steps between the readings: at least 1")
    return {name: (after[name] - before[name]) / steps for name in after if name in before}
