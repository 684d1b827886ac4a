"""A replica that fails its pool's averaging (out of device memory in an averaging buffer, here
`SWARM_FAULTS`' `averaging-oom`, armed twice so that it fails the retry too if it is in it): real
stage servers in this process, two replicas of the last stage. Its partner learns at once (not
at the averaging timeout), the failing replica is left out of the retry, its microbatches are
replayed on the other, and the job ends with `swarm local`'s parameters."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from scheduler.coordinator import LocalCoordinator, gather_state
from scheduler.coordinator.metrics import CoordinatorMetrics
from swarm.job.fingerprint import fingerprint
from swarm.job.rule import RuleKind
from swarm.model.routes import Record
from swarm.ops import faults
from swarm.ops.progress import StepRecord
from tests.support.equality import assert_equal_to_reference
from tests.support.inprocess import Swarm
from tests.support.jobs import make_job, with_rule

# Far above any honest step of this tiny job: a partner waiting it out would fail the test.
AVERAGING_TIMEOUT_S = 600.0
pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def disarmed() -> Iterator[None]:
    yield
    faults.arm("")


@pytest.mark.parametrize("kind", [RuleKind.SYNC, RuleKind.LOCAL])
async def test_a_replica_out_of_memory_in_averaging_is_left_out_and_its_partner_told_at_once(
    tmp_path: Path, make_swarm: list[Swarm], disarmed: None, kind: RuleKind
) -> None:
    """Step 1's commit (the synchronous rule), or the round ending after it (local steps,
    rounds of two: the round is averaged as step 2 begins, and the replica left out drops its
    samples of the round, which the route record says)."""
    job = make_job(
        tmp_path,
        "test",
        **with_rule(
            kind,
            training={"stages": 2, "steps": 4, "target_batch_size": 16},
            runtime={"averaging_timeout_s": AVERAGING_TIMEOUT_S},
        ),
    )
    at = 1 if kind is RuleKind.SYNC else 2
    swarm = Swarm(job)
    make_swarm.append(swarm)
    for stage in (0, 1, 1):
        await swarm.add(stage)
    # One of the two replicas of stage 1 (named: the servers share this process's faults) runs
    # out of memory averaging step `at`, and would again in the retry if it were in it.
    failing = swarm.servers[1][0].servicer.peer
    faults.arm(f"{failing}:averaging-oom@{at},{failing}:averaging-oom@{at}")
    ended: dict[int, float] = {}

    def after_step(record: StepRecord) -> None:
        ended[record.step] = time.monotonic()

    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(fingerprint(job), registry)
    routes: list[Record] = []
    coordinator = LocalCoordinator(
        job,
        fingerprint(job),
        swarm.members,
        on_step=after_step,
        metrics=metrics,
        on_route=routes.append,
    )
    await swarm.train(coordinator, trainers=1)
    # Before: the failing replica raised before it sent; its partner waited out the whole
    # averaging timeout for it, and the retry took the same group.
    took = ended[at] - ended[at - 1]
    assert took < AVERAGING_TIMEOUT_S / 10, f"step {at} took {took:.1f} s"
    assert faults.armed() == [faults.Fault(failing, faults.Point.AVERAGING_OOM, at)], (
        "the retry must have left the failing replica out: the second fault never fired"
    )
    aborted = registry.get_sample_value(
        "swarm_coordinator_aborted_rounds_total", {"job": fingerprint(job)}
    )
    assert aborted == 1
    assert_equal_to_reference(job, await gather_state(coordinator), routes, tol=1e-9)
    await coordinator.close()
    # The replica left out rejoins by copying its partner and following its updates until it
    # is admitted, which the job may end before: its copy is let go before the servers stop
    # (else the stop waits for it, until the copy's own stall timeout).
    swarm.servers[1][0].servicer.release()
