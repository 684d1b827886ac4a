"""Every process a test started is killed after it, however the test ended (`kill_leftovers`,
autouse in tests/conftest.py), failed by pytest-timeout included.

A test's processes are the test process's descendants that were not there before it, read from
/proc (no extra dependency); the fork servers (`tests.support.forked`) serve every test and stay.
That alone missed the processes whose parent died first: when pytest-timeout fails a test that
waits in `subprocess.run` (a `swarm demo`, a benchmark), `subprocess.run` SIGKILLs the process it
started and nothing else, and its scheduler and stage servers, orphaned, went to init (pid 1),
out of the test process's tree, and ran on after the suite. So the test process is made a child
subreaper (Linux's `PR_SET_CHILD_SUBREAPER`): an orphan among its descendants is re-parented to
it instead, stays in its tree, and is killed and reaped here. Sessions (`start_new_session`) and
namespaces (`ip netns exec`) never left the tree; a container's monitor (podman's conmon, which
daemonizes) is adopted now too, and the container tests remove their containers before this
runs (an autouse fixture is torn down last)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import forked

__all__ = ["become_subreaper", "children", "kill_leftovers"]

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
REAP_S = 5.0  # a SIGKILLed child is dead within this (one in the kernel's D state may not be)


def become_subreaper() -> None:
    """This process adopts its descendants' orphans (for the rest of its life; idempotent)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process, from /proc."""
    table: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # The command name may contain spaces and parentheses: split after the last ')'.
            fields = stat.rsplit(")", 1)[1].split()
            table[int(entry.name)] = (int(fields[1]), fields[0])
    return table


def children(pid: int, table: dict[int, tuple[int, str]] | None = None) -> set[int]:
    """Every live (not zombie) descendant of `pid`, in `table` (by default read now)."""
    parents = {c: p for c, (p, state) in (table or _table()).items() if state != "Z"}
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - found
        found |= frontier
    return found


def _zombies(pid: int, table: dict[int, tuple[int, str]] | None = None) -> set[int]:
    """`pid`'s own children that have exited and wait to be reaped, in `table` (by default
    read now)."""
    return {c for c, (p, state) in (table or _table()).items() if p == pid and state == "Z"}


@pytest.fixture(autouse=True)
def kill_leftovers() -> Iterator[None]:
    me = os.getpid()
    become_subreaper()
    # /proc is read once before the test and once after it (thrice where it left processes):
    # each read is every process's stat file, a few ms of CPU, for each of the suite's tests.
    table = _table()
    before = children(me, table) | _zombies(me, table)
    yield
    servers = forked.server_pids()  # serve every test; their children are covered here
    table = _table()
    leftovers = children(me, table) - before - servers
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    # Reaped as well, the ones that are this process's children: the adopted orphans (nobody
    # else waits for them) and what the test started and left (its `Popen` then reads 0).
    if leftovers:  # read again: what the kills orphaned is this process's now
        table = _table()
    mine = {pid for pid in leftovers if table.get(pid, (0, ""))[0] == me}
    deadline = time.monotonic() + REAP_S
    while mine and time.monotonic() < deadline:
        for pid in list(mine):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    continue  # SIGKILLed, not yet dead
            mine.discard(pid)
        time.sleep(0.01)
    # orphans adopted and ended by themselves (and, where it killed some, those it killed)
    for pid in _zombies(me, _table() if leftovers else table) - before:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
