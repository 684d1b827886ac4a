"""`training.delayed_update`: step t computes on the parameters before step t-1's update, so each
step's averaging and update overlap the next step's microbatches. The reference implements the
same rule; the swarm must equal it (float64, 1e-9) with the overlap really happening, through
replays, joins, kills during the overlapped averaging, and rollback."""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from scheduler.coordinator import LocalCoordinator, gather_state
from scheduler.coordinator.membership import Membership
from scheduler.coordinator.metrics import CoordinatorMetrics
from stage_server.replica.runtime import StageRuntime
from swarm.clock import MonotonicClock
from swarm.errors import FailedPrecondition, InvalidArgument
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.model.data import make_data
from swarm.model.optim import computes_on
from swarm.model.reference import train_local
from swarm.model.transformer import build_model, loss_sum
from swarm.ops.progress import StepRecord
from swarm.rpc.lease import Lease, MicrobatchResult, Replica, Working
from swarm.wire.crossing import Crossing
from tests.support.equality import assert_equal_to_local, assert_states_within
from tests.support.inprocess import Swarm, lease_after_joined
from tests.support.jobs import DELAYED, make_job


def _sgd_job(tmp_path: Path, name: str, **training: object) -> JobConfig:
    return make_job(
        tmp_path,
        name,
        training={"stages": 1, "steps": 2, **training},
        optimizer={"kind": "sgd", "lr": 0.5, "weight_decay": 0.0},
    )


def test_the_rule_steps_0_and_1_on_the_initial_parameters_then_one_step_behind(
    tmp_path: Path,
) -> None:
    job = make_job(tmp_path, training={"steps": 5, **DELAYED})
    assert [computes_on(job, s) for s in range(6)] == [0, 0, 1, 2, 3, 5]  # 5: final evaluation
    sync = make_job(tmp_path, "sync", training={"steps": 5})
    assert [computes_on(sync, s) for s in range(6)] == [0, 1, 2, 3, 4, 5]
    assert fingerprint(job) != fingerprint(sync)  # it changes the maths


def test_the_reference_is_sgd_with_a_gradient_one_step_stale(tmp_path: Path) -> None:
    # Worked by hand with plain SGD: w1 = w0 - lr g0(w0), w2 = w1 - lr g1(w0).
    job = _sgd_job(tmp_path, "delayed", **DELAYED)
    model, data, lr = build_model(job, "cpu"), make_data(job), 0.5

    def grad(step: int) -> list[torch.Tensor]:
        model.zero_grad()
        samples = 0
        for index in range(job.training.microbatches_per_step):
            inputs, targets = data.microbatch(step, index)
            loss_sum(model(inputs), targets).backward()
            samples += int(inputs.shape[0])
        return [p.grad.detach() / samples for p in model.parameters()]  # type: ignore[union-attr]

    g0, g1 = grad(0), grad(1)  # both at w0
    with torch.no_grad():
        for p, a, b in zip(model.parameters(), g0, g1, strict=True):
            p.sub_(lr * a).sub_(lr * b)
    expected = {k: v.detach() for k, v in model.state_dict().items()}
    assert_states_within(train_local(job).state_dict(), expected, 1e-12)
    sync = train_local(_sgd_job(tmp_path, "sync")).state_dict()
    far = max((sync[k] - v).abs().max().item() for k, v in expected.items())
    assert far > 1e-6, far  # the staleness is not idle


def _microbatch(rt: StageRuntime, step: int, index: int) -> None:
    inputs, targets = make_data(rt.job).microbatch(step, index)
    rt.forward_backward(step, index, Crossing(inputs), targets)


def _all(rt: StageRuntime, step: int) -> list[int]:
    indices = list(range(rt.job.training.microbatches_per_step))
    for index in indices:
        _microbatch(rt, step, index)
    return indices


def _samples(rt: StageRuntime) -> int:
    return rt.job.training.target_batch_size


def test_a_replica_computes_the_next_step_while_its_own_is_committed(tmp_path: Path) -> None:
    # One stage, the swarm's order of events: step t+1's microbatches run before step t's
    # commit, a replay of step t after them, a discarded microbatch of step t+1 run again.
    job = make_job(tmp_path, training={"stages": 1, "steps": 4, **DELAYED})
    rt = StageRuntime(job, 0)
    indices = _all(rt, 0)
    with pytest.raises(FailedPrecondition, match="has not started here"):
        _microbatch(rt, 2, 0)  # two steps ahead: not open anywhere
    for step in range(job.training.steps):
        if step + 1 < job.training.steps:
            _microbatch(rt, step + 1, 0)  # the next step starts before this one commits
            assert rt.discard(step + 1) == 1  # ... its work is voided, and done again
            _all(rt, step + 1)
        rt.discard(step)  # a failed round: step t replayed, on the parameters it used before
        _all(rt, step)
        assert rt.commit(step, indices, _samples(rt)) is False
        assert rt.step == step + 1
    with pytest.raises(FailedPrecondition, match="stale"):
        _microbatch(rt, 2, 0)
    assert_equal_to_local(job, rt.state_dict(), 1e-12)


def test_a_copy_of_a_replica_computes_as_it_does(tmp_path: Path) -> None:
    # A state of a delayed job carries the parameters its open step computes on (`prev/`):
    # a replica loaded from it (a joiner, a rollback) computes step t's gradient identically.
    job = make_job(tmp_path, training={"stages": 1, "steps": 4, **DELAYED})
    source = StageRuntime(job, 0)
    for step in range(2):
        source.commit(step, _all(source, step), _samples(source))
    state = source.export_state()
    assert any(k.startswith("prev/") for k in state)
    assert not any(k.startswith("prev/") for k in source.export_state(include_optimizer=False))
    copy = StageRuntime(job, 0)
    copy.load_state(2, state)
    for rt in (source, copy):
        rt.commit(2, _all(rt, 2), _samples(rt))
        _all(rt, 3)  # on the parameters after step 2's update: w^(3)
        rt.commit(3, list(range(job.training.microbatches_per_step)), _samples(rt))
    for k, v in source.state_dict().items():
        assert torch.equal(v, copy.state_dict()[k]), k
    missing = {k: v for k, v in state.items() if not k.startswith("prev/")}
    # refused before anything of it is loaded: the module and its optimizer were overwritten
    # first, and a replica (a standby copying anew) was left a mix of two states at its old step
    other = StageRuntime(job, 0)
    before = {k: v.clone() for k, v in other.export_state().items()}
    with pytest.raises(InvalidArgument, match="prev/"):
        other.load_state(2, missing)
    after = other.export_state()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    StageRuntime(job, 0).load_state(0, missing)  # at step 0 the parameters are their own prev


async def _train_in_process(
    swarm: Swarm, coordinator: LocalCoordinator, trainers: int
) -> list[tuple[str, int]]:
    """Run the job; the order of events: ("leased", step) for each task a trainer got,
    ("reported", step) for each result, and ("applied", step) when a step's commit was
    applied."""
    events: list[tuple[str, int]] = []
    lease, report = coordinator.lease, coordinator.report

    async def reported(trainer: str, result: MicrobatchResult) -> None:
        events.append(("reported", result.step))
        await report(trainer, result)

    async def recorded(
        trainer: str, count: int, *, wait_s: float = 0.0, working: Sequence[Working] = ()
    ) -> Lease:
        got = await lease(trainer, count, wait_s=wait_s, working=working)
        events.extend(("leased", task.step) for task in got.tasks)
        return got

    coordinator.lease = recorded  # type: ignore[method-assign]
    coordinator.report = reported  # type: ignore[method-assign]
    on_step = coordinator.on_step

    def applied(record: StepRecord) -> Awaitable[None] | None:
        events.append(("applied", record.step))
        return on_step(record) if on_step is not None else None

    coordinator.on_step = applied
    await swarm.train(coordinator, trainers)
    return events


def _overlapped(events: list[tuple[str, int]]) -> set[int]:
    """The steps of which a task was leased before the step before it was applied."""
    applied: set[int] = set()
    steps = set()
    for kind, step in events:
        if kind == "applied":
            applied.add(step)
        elif kind == "leased" and step > 0 and step - 1 not in applied:
            steps.add(step)
    return steps


def _undrained(events: list[tuple[str, int]]) -> set[int]:
    """The steps of which a task was leased before the last result of the step before it."""
    last = {step: i for i, (kind, step) in enumerate(events) if kind == "reported"}
    return {
        step
        for i, (kind, step) in enumerate(events)
        if kind == "leased" and step > 0 and i < last[step - 1]
    }


async def test_pools_overlap_each_commit_with_the_next_step_and_equal_local(
    tmp_path: Path, make_swarm: list[Swarm]
) -> None:
    job = make_job(tmp_path, training={"steps": 5, "target_batch_size": 32, **DELAYED})
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(2)
    records: list[StepRecord] = []

    def after_step(record: StepRecord) -> None:
        swarm.assert_replicas_identical()  # bitwise, after every step
        records.append(record)

    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members, on_step=after_step)
    events = await _train_in_process(swarm, coordinator, trainers=2)
    assert [r.step for r in records] == [0, 1, 2, 3, 4]
    # Every step after the first started while the one before it was committed.
    assert _overlapped(events) == {1, 2, 3, 4}, events
    # ... and some before the step before it had drained: its last microbatches in flight.
    assert _undrained(events), events
    assert_equal_to_local(job, await gather_state(coordinator))
    await coordinator.close()
    # The synchronous coordinator never overlaps a step's compute with the step before.
    sync = make_job(tmp_path, "sync", training={"steps": 3, "target_batch_size": 32})
    swarm = Swarm(sync)
    make_swarm.append(swarm)
    await swarm.add_replicas(1)
    synced: list[StepRecord] = []
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(fingerprint(sync), registry)
    coordinator = LocalCoordinator(
        sync, fingerprint(sync), swarm.members, on_step=synced.append, metrics=metrics
    )
    events = await _train_in_process(swarm, coordinator, trainers=2)
    # It leases a step only once the step before drained and was decided (every PREPARE
    # answered: its APPLYs may still be answering, issue 69), and each step computes on the
    # parameters after the one before: exactly the reference.
    assert _undrained(events) == set()
    assert_equal_to_local(sync, await gather_state(coordinator))
    # There, every commit blocks the leases: each step's record and the counter say how long.
    assert all(r.blocked_seconds > 0 for r in synced), synced
    counted = registry.get_sample_value(
        "swarm_coordinator_blocked_seconds_total", {"job": fingerprint(sync)}
    )
    assert counted == pytest.approx(sum(r.blocked_seconds for r in synced))
    await coordinator.close()


async def test_a_replica_joining_mid_job_computes_as_the_others(
    tmp_path: Path, make_swarm: list[Swarm]
) -> None:
    job = make_job(tmp_path, training={"steps": 8, "target_batch_size": 32, **DELAYED})
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(1)
    joined = []

    async def after_step(record: StepRecord) -> None:
        if record.step == 1:
            joined.append(await swarm.add(2))

    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members, on_step=after_step)
    # Steps 5 to 7 wait for it to be a member (a bounded wait): it has steps to work in.
    lease_after_joined(coordinator, joined, 5)
    await _train_in_process(swarm, coordinator, trainers=1)
    assert joined and joined[0].runtime.step == 8
    swarm.assert_replicas_identical()
    samples = joined[0].servicer.metrics.registry.get_sample_value(
        "swarm_stage_samples_total", dict(joined[0].servicer.metrics.values)
    )
    assert samples and samples > 0  # it did work after joining, on the parameters it copied
    assert_equal_to_local(job, await gather_state(coordinator))
    await coordinator.close()


async def test_a_joiner_admitted_between_commits_is_never_asked_to_join_again() -> None:
    # admit_copies admits a joiner while its own asks pause; the next boundary's must not ask
    # it (a member now) to Join: its copy ended at its first PREPARE, so the Join would start
    # another, whose older state would overwrite the steps it applied as a member.
    source, joiner = Replica("member", "member:1"), Replica("joiner", "joiner:1")
    asked: list[int] = []

    class Client:
        async def join(
            self, address: str, step: int, source_peer: str = "", rollback_epoch: int = 0
        ) -> int:
            asked.append(step)
            return step  # a copy at the open step

    class Clients:
        def get(self, stage: int, replica: Replica) -> Client:
            return Client()

    registry = CollectorRegistry()
    membership = Membership(
        "job",
        lambda: [[source, joiner]],
        Clients(),  # type: ignore[arg-type]
        list,
        CoordinatorMetrics("job", registry),
        MonotonicClock(),
    )
    membership.synced = {source.peer}
    membership._copying[joiner.peer] = (0, joiner, source)  # its Join started a copy
    await membership.admit_copies(3)
    assert joiner.peer in membership.synced and asked == [3]
    await membership.admit_copies(4)  # the next boundary, its own ask still pausing
    assert asked == [3]


# -- real processes, SIGKILL ---------------------------------------------------------------------
