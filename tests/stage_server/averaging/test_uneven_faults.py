"""Uneven parts against real stage-server processes: the owner of the largest part is killed
with SIGKILL inside a step's averaging round (a client-mode member in the same pool); the round
is retried without it, the job ends with `swarm local`'s parameters (float64, within 1e-9)."""

from __future__ import annotations

import functools
import signal
from pathlib import Path

import pytest

from client import standalone
from scheduler.coordinator import LocalCoordinator
from scheduler.coordinator.groups import Groups, Link
from swarm.ops.faults import Fault, Point
from tests.support.equality import assert_equal_to_local
from tests.support.jobs import write_job
from tests.support.servers import Servers, counted, train_on

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MBIT = 1e6 / 8


def test_the_largest_parts_owner_killed_mid_round_the_retry_without_it_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = write_job(tmp_path, training={"steps": 4, "target_batch_size": 16})
    # Stage 0: s0r0 on 10 Mbit/s (a client: owns nothing), s0r1 on 100 (owns 7/8), s0r2 on 60.
    rates = {"s0r0": 10 * MBIT, "s0r1": 100 * MBIT, "s0r2": 60 * MBIT}
    fault = Fault("s0r1", Point.AVERAGING, 2)
    servers = Servers(job, [3, 1, 1, 1], [fault], tmp_path)
    groups = Groups(lambda peer: Link(rates.get(peer, 0.0)))
    weights = groups.of(0, servers.replicas()[0]).parts.weights
    assert weights[0] == 0 and weights[1] == max(weights)
    # The real coordinator, sizing parts by those links (standalone has no registry to ask).
    monkeypatch.setattr(
        standalone, "LocalCoordinator", functools.partial(LocalCoordinator, groups=groups)
    )
    victim = servers.procs[fault.target]
    try:
        state, registry = train_on(servers)
    finally:
        servers.stop()
    assert victim.proc.returncode == -signal.SIGKILL, "the fault must have killed the owner"
    assert counted(registry, "swarm_coordinator_aborted_rounds_total") >= 1
    assert_equal_to_local(job, state, tol=1e-9)
