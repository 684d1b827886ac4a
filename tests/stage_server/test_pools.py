"""Replica pools with real gRPC servers (in this process, so every replica's state can be
inspected after each step): several trainers, averaging, joining mid-job, lease races."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from client.trainer import PipelineTrainer
from scheduler.coordinator import LocalCoordinator, gather_model, gather_state
from stage_server.runtime import StageRuntime
from stage_server.server import RunningStageServer
from swarm.errors import FailedPrecondition
from swarm.job.fingerprint import fingerprint
from swarm.ops.progress import StepRecord
from swarm.rpc.lease import Replica, Task
from tests.support.equality import assert_equal_to_local
from tests.support.inprocess import Swarm, lease_after_joined
from tests.support.jobs import make_job


async def test_two_replicas_per_stage_and_two_trainers_equal_local(
    tmp_path: Path, make_swarm: list[Swarm]
) -> None:
    job = make_job(tmp_path, training={"steps": 4, "target_batch_size": 32})
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(2)
    checked: list[int] = []

    def after_step(record: StepRecord) -> None:
        swarm.assert_replicas_identical()  # bitwise, after every step
        checked.append(record.step)

    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members, on_step=after_step)
    await swarm.train(coordinator, trainers=2)
    assert checked == [0, 1, 2, 3]
    # both replicas of every stage did work (the wiring spreads it)
    for stage in swarm.servers:
        for server in stage:
            text = server.servicer.metrics.registry.get_sample_value(
                "swarm_stage_optimizer_steps_total", dict(server.servicer.metrics.values)
            )
            assert text == 4
    assert_equal_to_local(job, await gather_state(coordinator))
    await coordinator.close()


async def test_replica_joining_mid_job_ends_identical(
    tmp_path: Path, make_swarm: list[Swarm]
) -> None:
    # The joiner copies a member in the background from the next boundary on, and is admitted
    # once caught up (a step or two later): 8 steps leave it steps to work in.
    job = make_job(tmp_path, training={"steps": 8, "target_batch_size": 32})
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(1)
    joined: list[RunningStageServer] = []

    async def after_step(record: StepRecord) -> None:
        if record.step == 1:  # a new replica of stage 2 appears during step 2
            joined.append(await swarm.add(2))

    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members, on_step=after_step)
    # Steps 5 to 7 wait for it to be a member (a bounded wait): it has steps to work in.
    lease_after_joined(coordinator, joined, 5)
    await swarm.train(coordinator, trainers=1)
    assert joined and joined[0].runtime.step == 8
    swarm.assert_replicas_identical()
    # it did real work after joining: it accumulated samples
    samples = joined[0].servicer.metrics.registry.get_sample_value(
        "swarm_stage_samples_total", dict(joined[0].servicer.metrics.values)
    )
    assert samples and samples > 0
    assert_equal_to_local(job, await gather_state(coordinator))
    await coordinator.close()


async def test_racing_trainers_never_count_a_microbatch_twice(
    tmp_path: Path, make_swarm: list[Swarm]
) -> None:
    # Leases expire quickly, so two trainers often compute the same microbatches on
    # different replicas; the ledger accepts one gradient per microbatch and stage and voids
    # replicas that hold a second one (their other microbatches are replayed).
    job = make_job(
        tmp_path,
        training={"steps": 2, "target_batch_size": 16, "stages": 2},
        runtime={"lease_timeout_s": 0.05},
    )
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(2)
    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members)
    await swarm.train(coordinator, trainers=2)
    swarm.assert_replicas_identical()
    assert_equal_to_local(job, await gather_state(coordinator))
    await coordinator.close()


async def test_the_model_is_taken_at_one_step(tmp_path: Path, make_swarm: list[Swarm]) -> None:
    # After training, one replica of stage 1 is put back to step 0 (a replica that missed the
    # last APPLY, say): the model comes from its peer, at the job's last step, or not at all.
    job = make_job(tmp_path, training={"steps": 2, "target_batch_size": 16})
    swarm = Swarm(job)
    make_swarm.append(swarm)
    for stage in range(4):
        for _ in range(2 if stage == 1 else 1):
            await swarm.add(stage)
    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members)
    await swarm.train(coordinator, trainers=1)
    initial = StageRuntime(job, 1, "cpu").export_state()
    behind, ahead = coordinator.replicas()[1]
    await coordinator.client(1, behind).load_state(0, initial)
    step, state = await gather_model(coordinator)
    assert step == 2
    assert_equal_to_local(job, state)
    await coordinator.client(1, ahead).load_state(0, initial)
    with pytest.raises(FailedPrecondition, match="is at step 0, not 2"):
        await gather_model(coordinator)
    await coordinator.close()


async def test_the_trainer_follows_moves_and_new_addresses(tmp_path: Path) -> None:
    # c moves from stage 2 to stage 1, a comes back at another address, d leaves.
    trainer = PipelineTrainer(make_job(tmp_path), coordinator=None)  # type: ignore[arg-type]
    try:
        trainer.sync([[Replica("a", "h:1")], [Replica("b", "h:2")], [Replica("c", "h:3")], [
            Replica("d", "h:4")]])  # fmt: skip
        first_a = trainer.clients["a"]
        trainer.sync([[Replica("a", "h:9")], [Replica("b", "h:2"), Replica("c", "h:3")], [], []])
        assert [trainer.wiring.stage_of(p) for p in "abcd"] == [0, 1, 1, None]
        assert trainer.wiring.choose(1, 1.0) in ("b", "c")
        assert trainer.clients["a"].address == "h:9" and trainer.clients["a"] is not first_a
        assert (trainer.clients["c"].address, trainer.clients["c"].stage) == ("h:3", 1)
        # the replaced clients of a and c, and departed d's (nothing kept of a peer that left),
        # closed later
        assert len(trainer._retiring) == 3 and "d" not in trainer.clients
        trainer.sync([])  # a lease before the job started: no view of the stages
        assert [trainer.wiring.stage_of(p) for p in "abcd"] == [0, 1, 1, None]
    finally:
        await trainer.close()


class _Releases:
    """A `Coordinator` that only records releases (the trainer under test leases nothing)."""

    def __init__(self) -> None:
        self.released: list[list[int]] = []

    async def release(self, trainer: str, indices: Sequence[int]) -> None:
        self.released.append(list(indices))


async def test_a_failed_microbatch_of_an_older_step_gives_nothing_back(tmp_path: Path) -> None:
    # No replica anywhere: every microbatch fails. The one of the step the trainer leases now is
    # given back; a straggler of an older step must not give away the same index of this one.
    coordinator = _Releases()
    trainer = PipelineTrainer(make_job(tmp_path), coordinator)  # type: ignore[arg-type]
    trainer._leased_step = 5
    try:
        await trainer._run_task(Task(step=4, index=1, stages=frozenset(range(4))))
        assert coordinator.released == []
        await trainer._run_task(Task(step=5, index=1, stages=frozenset(range(4))))
        assert coordinator.released == [[1]]
    finally:
        await trainer.close()
