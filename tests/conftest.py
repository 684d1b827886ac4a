"""Shared fixtures: leftover child processes are killed after every test; `make_swarm` makes
in-process swarms (`tests.support.inprocess`) and closes them after the test; `make_harness`
makes step coordinators over in-memory replicas (`tests.support.coordinator`); `api` is the job
API over a real store (`tests.support.api`); `pki` the swarm's CA and a stranger's
(`tests.support.tls`). The fixtures themselves live in `tests/support/`, one home per concept."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import forked

# Every scheduler the suite starts dials peers on loopback, or in namespaces on private and
# documentation ranges: it runs with `--dial-private` (as `swarm.local.procs` and
# `tests.support.namespaces` also say); `tests/system/test_dial_scope.py` starts one without.
os.environ.setdefault("SWARM_DIAL_PRIVATE", "1")
from tests.support.api import api  # noqa: F401
from tests.support.coordinator import make_harness  # noqa: F401
from tests.support.inprocess import make_swarm  # noqa: F401
from tests.support.tls import pki  # noqa: F401


def _children(pid: int) -> set[int]:
    """Every live descendant of `pid` (from /proc: no extra dependency)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # The command name may contain spaces and parentheses: split after the last ')'.
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - found
        found |= frontier
    return found


@pytest.fixture(autouse=True)
def _kill_leftover_children() -> Iterator[None]:
    before = _children(os.getpid())
    yield
    servers = forked.server_pids()  # serve every test; their children are covered here
    for pid in _children(os.getpid()) - before - servers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session", autouse=True)
def _fork_swarm_processes() -> Iterator[None]:
    """Start the suite's swarm processes from a fork server that imported torch once."""
    from swarm.local import procs

    procs.launcher = forked.launch
    yield
    procs.launcher = procs.spawn


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The test process does its torch work on one thread, as stage servers do (`--threads 1`):
    beside the swarm processes it starts (or anyone else's) on 2 cores, torch's second thread
    only contends (the reference training of a 40-step job: 1 s on one thread, over 60 s on
    two on a busy machine). At most the order of some float additions changes; every
    comparison keeps its tolerance."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
