"""Issue 55's poisoners as real stage-server processes (`SWARM_FAULTS`'s hostile points,
`stage_server.averaging.hostile`): one replica of a pool of three lies in every round from step
1 on, and the job still ends with `swarm local`'s parameters (float64, within 1e-9): its round
fails, it is left out, and its microbatches are replayed by the honest two."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.ops.faults import Fault, Point
from tests.support.equality import assert_equal_to_local
from tests.support.jobs import write_job
from tests.support.servers import Servers, counted, train_on

pytestmark = pytest.mark.timeout(400)


@pytest.mark.parametrize(
    "point",
    [
        pytest.param(Point.POISON_SUM, marks=pytest.mark.attack("55-owner")),
        pytest.param(Point.POISON_GRAD, marks=pytest.mark.attack("55-norm")),
    ],
)
def test_a_hostile_replica_process_cannot_poison_its_pool(tmp_path: Path, point: Point) -> None:
    """`poison-sum`: it answers its own part's sums plus 1e4 (the checksum names it);
    `poison-grad`: it contributes its gradient times 1e4 (the norm bound refuses it)."""
    job = write_job(tmp_path, training={"steps": 4, "target_batch_size": 16})
    servers = Servers(job, [3, 1, 1, 1], [Fault("s0r2", point, 1)], tmp_path)
    try:
        state, registry = train_on(servers)
    finally:
        servers.stop()
    assert_equal_to_local(job, state, tol=1e-9)
    assert counted(registry, "swarm_coordinator_aborted_rounds_total") >= 1
    log = next(tmp_path.glob("s0r2-*.log"), None)
    assert log is not None and f"fault injected: {point}" in log.read_text()
