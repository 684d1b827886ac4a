"""Issue 55, with real gRPC servers in this process (every replica's state at hand; the
process-per-server attacks are in tests/system/test_poison_audits.py): audits accuse no
honest replica (a
float64 job on either plane, every stage of every microbatch audited, three replicas a stage:
every audit agrees, bitwise on the CPU, nobody is banned, the model equals `swarm local`'s); and
a liar that joins late costs only the steps since the checkpoint before it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from client.metrics import TrainerMetrics
from client.trainer import PipelineTrainer
from scheduler.coordinator import LocalCoordinator, gather_state
from stage_server.server import RunningStageServer
from swarm.job.fingerprint import fingerprint
from swarm.ops.faults import Fault, Point
from swarm.ops.poison import Poison
from swarm.ops.progress import StepRecord
from tests.support.equality import assert_equal_to_local
from tests.support.inprocess import Swarm, lease_after_joined
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(180)


# on the push plane the stages are redone from the replicas' records, a contribution's from its
# neighbours' (`client.audit.push_contributions`)
@pytest.mark.parametrize("plane", ["relay", "push"])
async def test_an_honest_audited_job_accuses_nobody(
    tmp_path: Path, make_swarm: list[Swarm], plane: str
) -> None:
    job = make_job(
        tmp_path,
        training={"stages": 3, "steps": 4, "target_batch_size": 16},
        runtime={"data_plane": plane},
        trust={"audit_fraction": 1.0},
    )
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(3)
    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members)
    metrics = TrainerMetrics(fingerprint(job), CollectorRegistry())
    trainers = [PipelineTrainer(job, coordinator, metrics=metrics, seed=i) for i in range(2)]
    try:
        await coordinator.start()
        await asyncio.wait_for(
            asyncio.gather(*(t.run() for t in trainers), coordinator.finished.wait()), 120
        )
        assert coordinator.error is None
        assert_equal_to_local(job, await gather_state(coordinator), tol=1e-9)
    finally:
        for t in trainers:
            await t.close()
        await coordinator.close()
    agreed = metrics._audits.labels(job=fingerprint(job), outcome="agreed")._value.get()
    assert agreed >= 4 * 4 * 3  # every stage of every microbatch of every step
    for outcome in ("caught", "undecided", "skipped"):
        assert metrics._audits.labels(job=fingerprint(job), outcome=outcome)._value.get() == 0
    assert metrics.audit_difference._value.get() == 0.0  # bitwise, on the CPU
    assert coordinator.bans.banned == {}
    assert coordinator.metrics.bans._value.get() == 0
    # the price: every stage computation done twice more, every replica's contribution being
    # audited too (`audit_fraction` 1): its answers checked on one auditor, and its gradient
    # digested on that one and a second (`scheduler.coordinator.trust.contributions`)
    assert metrics.audit_runs._value.get() == 2 * metrics.stage_runs._value.get()


@pytest.mark.attack("P-acts")
@pytest.mark.attack("P-grads")
@pytest.mark.parametrize("poison", [Point.POISON_OUTPUTS, Point.POISON_GRAD_INPUTS])
async def test_a_liar_that_joins_late_costs_only_the_steps_since_the_checkpoint_before_it(
    tmp_path: Path, make_swarm: list[Swarm], poison: Point
) -> None:
    """A replica of stage 1 joins after step 2's checkpoint and lies from then on: it is caught
    and banned, and the job rolls back to the last checkpoint at or before the first step it was
    a member at, not to step 0 (the work before it is the honest run's), and still ends equal
    to `swarm local`."""
    job = make_job(
        tmp_path,
        training={"stages": 3, "steps": 7, "target_batch_size": 16, "checkpoint_every": 2},
        runtime={"data_plane": "relay"},
        trust={"audit_fraction": 1.0},
    )
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(2)
    joined: list[RunningStageServer] = []
    rolled: list[int] = []

    async def after_step(record: StepRecord) -> None:
        if record.step == 2 and not joined:
            liar = await swarm.add(1, Poison.of([Fault("", poison, 0)]))  # armed at its start
            joined.append(liar)

    coordinator = LocalCoordinator(
        job,
        fingerprint(job),
        swarm.members,
        on_step=after_step,
        checkpoint_dir=tmp_path / "checkpoints",
        on_rollback=rolled.append,
    )
    # Steps 4 on wait (a bounded wait) until it is a member, or was: banned, it is none again.
    lease_after_joined(coordinator, joined, 4, banned=coordinator.bans.banned.keys())
    await swarm.train(coordinator, trainers=2)
    (liar,) = joined
    assert list(coordinator.bans.banned) == [liar.address]
    first = coordinator.bans.first_seen[liar.address]
    assert first >= 3
    # the last checkpoint sealed at or before its first step: 2, or 4 when that one was sealed
    # by then (one is written in the background, or skipped while the one before is)
    assert len(rolled) == 1 and rolled[0] in (2, 4) and rolled[0] <= first, (rolled, first)
    assert_equal_to_local(job, await gather_state(coordinator), tol=1e-9)
    await coordinator.close()
