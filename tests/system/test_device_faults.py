"""Device failures in real stage-server processes (`SWARM_FAULTS`' raising points): a replica out
of memory in its Forward, inside its Backward, and in its pool's averaging (armed twice: it would
fail the retry too), each once, while it lives on. Every run ends with `swarm local`'s parameters
(float64, within 1e-9), and the out-of-memory error is logged naming the job, stage, size and
free memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.ops.faults import Fault, Point
from tests.support.equality import assert_equal_to_local
from tests.support.jobs import write_job
from tests.support.servers import Servers, counted, train_on

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.mark.parametrize(
    "points",
    [[Point.FORWARD_OOM], [Point.BACKWARD_OOM], [Point.AVERAGING_OOM, Point.AVERAGING_OOM]],
    ids=["forward", "backward", "averaging"],
)
def test_a_replica_out_of_memory_loses_nothing_and_the_job_stays_exact(
    tmp_path: Path, points: list[Point]
) -> None:
    job = write_job(tmp_path, training={"steps": 4, "target_batch_size": 16})
    victim = "s1r0"
    faults = [Fault(victim, point, 2) for point in points]
    servers = Servers(job, [1, 2, 1, 1], faults, tmp_path)
    try:
        state, registry = train_on(servers)
        logged = servers.procs[victim].log()
    finally:
        servers.stop()
    assert_equal_to_local(job, state, tol=1e-9)
    assert f"injected: SWARM_FAULTS {points[0]}@2" in logged, logged[-3000:]
    assert "stage 1: out of device memory in" in logged and "(cpu)" in logged
    if points[0] == Point.AVERAGING_OOM:
        # Left out of the retry (its second fault never fired), its microbatches replayed.
        assert logged.count(f"fault injected: {points[0]}@2") == 1, logged[-3000:]
        assert counted(registry, "swarm_coordinator_replays_total") >= 1
        assert counted(registry, "swarm_coordinator_aborted_rounds_total") == 1
