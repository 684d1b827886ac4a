"""Shared fixtures: leftover child processes are killed after every test, orphans included
(`tests.support.reaper`); `make_swarm` makes in-process swarms (`tests.support.inprocess`) and
closes them after the test; `make_harness` makes step coordinators over in-memory replicas
(`tests.support.coordinator`); `api` is the job API over a real store (`tests.support.api`);
`pki` the swarm's CA and a stranger's (`tests.support.tls`); every test starts on one torch thread
(`tests.support.threads`) and writes nothing into the repository (`tests.support.tree`). The
fixtures themselves live in `tests/support/`, one home per concept."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support import bytecode

# Before the suite's modules are imported, and before xdist starts its workers: bytecode kept
# outside the tree where the environment forbids it beside the sources (`tests.support.bytecode`).
bytecode.keep()
from tests.support import forked  # noqa: E402

# Every scheduler the suite starts dials peers on loopback, or in namespaces on private and
# documentation ranges: it runs with `--dial-private` (as `swarm.local.procs` and
# `tests.support.namespaces` also say); `tests/system/test_dial_scope.py` starts one without.
os.environ.setdefault("SWARM_DIAL_PRIVATE", "1")
# As a stage server on a GPU starts (`swarm.device.kernels`): cuBLAS repeatable before CUDA is
# touched, for the tests that build stages of an audited job (the default) on CUDA.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
from tests.support.api import api  # noqa: E402, F401
from tests.support.coordinator import make_harness  # noqa: E402, F401
from tests.support.inprocess import make_swarm  # noqa: E402, F401
from tests.support.reaper import kill_leftovers  # noqa: E402, F401
from tests.support.threads import one_torch_thread  # noqa: E402, F401
from tests.support.tls import pki  # noqa: E402, F401
from tests.support.tree import untouched_tree  # noqa: E402, F401


@pytest.fixture(scope="session", autouse=True)
def _fork_swarm_processes() -> Iterator[None]:
    """Start the suite's swarm processes from a fork server that imported torch once (those in
    the namespace lab's hosts too)."""
    from swarm.local import netns, procs

    procs.launcher, netns.launcher = forked.launch, forked.launch_in
    yield
    procs.launcher, netns.launcher = procs.spawn, netns.ip_netns_exec
