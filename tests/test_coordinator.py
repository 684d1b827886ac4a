"""The step coordinator against in-memory replicas (`tests.support.replicas`): the two-phase
commit, voids, joins and rollback, each interleaving fixed by the test (gates on the replicas'
calls, a `FakeClock` for leases and backoff)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from scheduler.coordinator import LocalCoordinator
from swarm.clock import FakeClock
from swarm.config import JobConfig
from swarm.errors import Aborted, PeerUnavailable
from swarm.lease import MicrobatchResult, Task
from swarm.progress import StepRecord
from swarm.stage_state import initial_state
from tests.support.jobs import make_job
from tests.support.replicas import FakeSwarm, Prepared

pytestmark = pytest.mark.timeout(60)

LEASE_S = 10.0  # the jobs' lease timeout, on the fake clock


def _job(tmp_path: Path, **training: Any) -> JobConfig:
    # Two stages, two microbatches of 4 samples per step.
    settings = {"stages": 2, "microbatch_size": 4, "target_batch_size": 8, "steps": 3}
    return make_job(tmp_path, training=settings | training, runtime={"lease_timeout_s": LEASE_S})


class Harness:
    """A coordinator over a `FakeSwarm`, with the step records and rollbacks it announced."""

    def __init__(self, job: JobConfig, swarm: FakeSwarm, **kwargs: Any) -> None:
        self.job, self.swarm, self.clock = job, swarm, FakeClock()
        self.steps: asyncio.Queue[StepRecord] = asyncio.Queue()
        self.rollbacks: asyncio.Queue[int] = asyncio.Queue()
        self.coordinator = LocalCoordinator(
            job,
            swarm.job_id,
            swarm.members,
            on_step=self.steps.put_nowait,
            on_rollback=self.rollbacks.put_nowait,
            connect=swarm.connect,
            clock=self.clock,
            **kwargs,
        )

    async def lease(self, trainer: str = "t", count: int = 8) -> list[Task]:
        """The next tasks `trainer` gets, once a commit in flight has ended."""
        for _ in range(2000):
            lease = await self.coordinator.lease(trainer, count)
            if lease.tasks or lease.done:
                return lease.tasks
            await asyncio.sleep(0.001)
        raise AssertionError("no work was leased")

    async def run(
        self, task: Task, at: dict[int, str] | None = None, trainer: str = "t", report: bool = True
    ) -> MicrobatchResult:
        """Run `task` as a trainer would: its gradient lands at each of its stages on the peer
        `at` names (else the stage's first member), then the trainer reports it."""
        holders = {}
        for stage in sorted(task.stages):
            peer = (at or {}).get(stage) or self.coordinator.replicas()[stage][0].peer
            self.swarm[peer].accumulate(task.index)
            holders[stage] = peer
        last = self.job.training.stages - 1
        loss = 1.0 if last in task.stages else None
        result = MicrobatchResult(task.step, task.index, holders, loss, 4)
        if report:
            await self.coordinator.report(trainer, result)
        return result

    async def step(self, at: dict[int, str] | None = None) -> StepRecord:
        """Train one whole step; returns its record once committed."""
        for task in await self.lease():
            await self.run(task, at)
        return await asyncio.wait_for(self.steps.get(), 10)


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(5000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("timed out waiting")


@pytest.fixture
async def harnesses() -> AsyncIterator[list[Harness]]:
    made: list[Harness] = []
    yield made
    for h in made:
        await h.coordinator.close()


def _harness(made: list[Harness], job: JobConfig, swarm: FakeSwarm, **kwargs: Any) -> Harness:
    made.append(Harness(job, swarm, **kwargs))
    return made[-1]


async def test_commit_prepares_every_replica_then_applies_and_opens_the_next_step(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    job = _job(tmp_path)
    swarm = FakeSwarm(job.fingerprint(), 2)
    a, b, c = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    h = _harness(harnesses, job, swarm)
    assert await h.coordinator.start() == 0
    tasks = await h.lease()
    assert tasks == [Task(0, 0, frozenset({0, 1})), Task(0, 1, frozenset({0, 1}))]
    await h.run(tasks[0], {0: "a"})
    await h.run(tasks[1], {0: "b"})
    record = await asyncio.wait_for(h.steps.get(), 10)
    assert (record.step, record.samples, record.loss) == (0, 8, 2.0 / 8)

    group0 = ["fake:a", "fake:b"]
    assert a.called("prepare") == [Prepared(0, [0], 8, group0, 0, "0/0")]
    assert b.called("prepare") == [Prepared(0, [1], 8, group0, 1, "0/0")]
    assert c.called("prepare") == [Prepared(0, [0, 1], 8, ["fake:c"], 0, "0/0")]
    phases = [method for _, method in swarm.log if method in ("prepare", "apply")]
    assert phases == ["prepare"] * 3 + ["apply"] * 3  # no APPLY before every PREPARE succeeded
    assert all(r.called("apply") == [0] and r.step == 1 for r in (a, b, c))
    assert h.coordinator.ledger is not None and h.coordinator.ledger.step == 1
    assert {t.step for t in await h.lease()} == {1}


async def test_receipts_beyond_the_ledger_void_the_replica_before_prepare(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    job = _job(tmp_path)
    swarm = FakeSwarm(job.fingerprint(), 2)
    a, b, c = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    h = _harness(harnesses, job, swarm)
    await h.coordinator.start()
    first, second = await h.lease()
    await h.run(first, {0: "a"})
    a.accumulate(1)  # a straggler's gradient of microbatch 1 that was never reported
    await h.run(second, {0: "b"})
    # Info shows a holding [0, 1] where the ledger accepted [0]: a is voided, nobody prepares,
    # and microbatch 0 is needed again at stage 0 only.
    assert await h.lease() == [Task(0, 0, frozenset({0}))]
    assert a.called("discard") == [0] and not a.receipts
    assert not any(r.called("prepare") for r in (a, b, c))
    await h.run(Task(0, 0, frozenset({0})), {0: "b"})
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 0
    assert a.called("prepare")[-1].microbatches == []
    assert b.called("prepare")[-1].microbatches == [0, 1]
    assert c.called("prepare")[-1].microbatches == [0, 1]


async def test_a_replica_gone_during_prepare_is_dropped_and_the_step_commits_after_replay(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    job = _job(tmp_path)
    swarm = FakeSwarm(job.fingerprint(), 2)
    a, b, c = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    a.fail("prepare", PeerUnavailable("UNAVAILABLE: connection refused"))
    h = _harness(harnesses, job, swarm)
    await h.coordinator.start()
    first, second = await h.lease()
    await h.run(first, {0: "a"})
    await h.run(second, {0: "b"})
    replay = await h.lease()
    assert replay == [Task(0, 0, frozenset({0}))]  # a's microbatch, at a's stage only
    assert [r.peer for r in h.coordinator.replicas()[0]] == ["b"]
    await h.run(replay[0], {0: "b"})
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 0
    assert b.called("prepare")[-1] == Prepared(0, [0, 1], 8, ["fake:b"], 0, "0/1")
    assert c.called("prepare")[-1].round == "0/1"
    assert a.called("apply") == [] and (b.step, c.step) == (1, 1)


async def test_an_aborted_round_is_retried_under_a_new_round_id(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    job = _job(tmp_path)
    swarm = FakeSwarm(job.fingerprint(), 2)
    a, b, c = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    b.fail("prepare", Aborted("round 0/0: a member did not send its part"))
    h = _harness(harnesses, job, swarm)
    await h.coordinator.start()
    first, second = await h.lease()
    await h.run(first, {0: "a"})
    await h.run(second, {0: "b"})
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 0  # by itself: nothing was lost
    assert [p.round for p in b.called("prepare")] == ["0/0", "0/1"]
    assert a.called("prepare")[1] == Prepared(0, [0], 8, ["fake:a", "fake:b"], 0, "0/1")
    assert not any(r.called("discard") for r in (a, b, c))  # Aborted voids nobody


async def test_a_joiner_copies_a_member_at_the_boundary_and_one_that_fails_backs_off(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    job = _job(tmp_path, steps=5)
    swarm = FakeSwarm(job.fingerprint(), 2)
    swarm.add(0, "a"), swarm.add(1, "c")
    h = _harness(harnesses, job, swarm)
    await h.coordinator.start()
    n, m = swarm.add(0, "n"), swarm.add(1, "m")  # appear during step 0
    m.fail("join", PeerUnavailable("UNAVAILABLE: m is not listening yet"))
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a"], ["c"]]
    await h.step()
    # at the boundary: n copied a (step 1) and is a member; m failed and is not
    assert n.called("join") == ["fake:a"] and n.step == 1
    assert m.called("join") == ["fake:c"]
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a", "n"], ["c"]]
    await h.step(at={0: "n"})
    assert n.called("prepare")[-1] == Prepared(1, [0, 1], 8, ["fake:a", "fake:n"], 1, "1/0")
    assert len(m.called("join")) == 1  # still backing off: no try at this boundary
    h.clock.advance(60)
    await h.step()
    assert len(m.called("join")) == 2 and m.step == 3
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a", "n"], ["c", "m"]]
    # a peer that left: forgotten at the next boundary, its connection closed
    swarm.remove("n")
    await h.step()
    assert n.closed == 1 and len(h.coordinator.clients) == 3


async def test_a_lost_stage_rolls_every_stage_back_to_the_last_checkpoint(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    job = _job(tmp_path, steps=5, checkpoint_every=2)
    swarm = FakeSwarm(job.fingerprint(), 2)
    a, c = swarm.add(0, "a"), swarm.add(1, "c")
    h = _harness(harnesses, job, swarm, checkpoint_dir=tmp_path / "checkpoints")
    await h.coordinator.start()
    for _ in range(3):
        await h.step()
    assert (a.step, c.step) == (3, 3)
    swarm.remove("c")  # stage 1 lost its only replica; d comes up empty
    d = swarm.add(1, "d")
    assert (await h.coordinator.lease("t", 8)).tasks == []  # no work: a stage has no member
    assert await asyncio.wait_for(h.rollbacks.get(), 10) == 2
    assert a.called("load_state") == [2] and d.called("load_state") == [2]
    assert torch.equal(a.state["w"], torch.tensor([2.0])) and d.state["w"].item() == 2.0
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a"], ["d"]]
    tasks = await h.lease()
    assert {t.step for t in tasks} == {2}  # data position included: step 2's microbatches
    for task in tasks:
        await h.run(task)
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 2


async def test_without_a_checkpoint_a_rollback_goes_to_step_0s_initial_state(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    job = _job(tmp_path)
    swarm = FakeSwarm(job.fingerprint(), 2)
    a, _ = swarm.add(0, "a"), swarm.add(1, "c")
    h = _harness(harnesses, job, swarm)
    await h.coordinator.start()
    await h.step()
    swarm.remove("c")
    d = swarm.add(1, "d")
    await h.coordinator.lease("t", 8)
    assert await asyncio.wait_for(h.rollbacks.get(), 10) == 0
    for replica, stage in ((a, 0), (d, 1)):
        expected = initial_state(job, stage)
        assert replica.step == 0 and replica.state.keys() == expected.keys()
        assert all(torch.equal(replica.state[k], v) for k, v in expected.items())
    assert h.coordinator.ledger is not None and h.coordinator.ledger.step == 0


async def test_a_void_landing_while_the_commit_gathers_receipts_stops_the_prepare(
    tmp_path: Path, harnesses: list[Harness]
) -> None:
    job = _job(tmp_path)
    swarm = FakeSwarm(job.fingerprint(), 2)
    p, q, c = swarm.add(0, "p"), swarm.add(0, "q"), swarm.add(1, "c")
    h = _harness(harnesses, job, swarm)
    await h.coordinator.start()
    # Trainer A leases microbatch 0 and is slow: its lease expires and B takes both.
    assert await h.lease("A", 1) == [Task(0, 0, frozenset({0, 1}))]
    h.clock.advance(LEASE_S + 1)
    first, second = await h.lease("B", 2)
    straggler = await h.run(first, {0: "p"}, trainer="A", report=False)
    gathering = p.hold("info")
    await h.run(first, {0: "q"}, trainer="B")
    await h.run(second, {0: "p"}, trainer="B")  # the ledger is complete: the commit starts
    await asyncio.wait_for(gathering.entered.wait(), 10)
    # While the receipts are gathered, A reports microbatch 0 at stage 0 on p, where q's was
    # accepted: p is voided (its microbatch 1 is needed again at stage 0) and discards all.
    await h.coordinator.report("A", straggler)
    assert p.called("discard") == [0] and not p.receipts
    gathering.open()  # p's Info now shows no receipts: it matches p's emptied holdings
    assert await h.lease("B", 2) == [Task(0, 1, frozenset({0}))]
    assert not any(r.called("prepare") for r in (p, q, c))  # not on an incomplete ledger
    await h.run(Task(0, 1, frozenset({0})), {0: "q"}, trainer="B")
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 0
    assert q.called("prepare") == [Prepared(0, [0, 1], 8, ["fake:p", "fake:q"], 1, "0/1")]
    assert p.called("prepare")[-1].microbatches == []
