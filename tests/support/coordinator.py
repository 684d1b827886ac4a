"""A step coordinator over in-memory replicas (`tests.support.replicas`), with the step records
and rollbacks it announced: the harness of the coordinator's unit tests (`make_harness` makes
them and closes each after the test)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import pytest

from scheduler.coordinator import LocalCoordinator
from swarm.clock import FakeClock
from swarm.deadline import within
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.ops.progress import StepRecord
from swarm.rpc.lease import MicrobatchResult, Task
from tests.support.jobs import make_job
from tests.support.replicas import FakeSwarm
from tests.support.waiting import wait_until

__all__ = ["LEASE_S", "Harness", "MakeHarness", "job_of", "make_harness", "started", "until"]

LEASE_S = 10.0  # the jobs' lease timeout, on the fake clock


def job_of(tmp_path: Path, **training: Any) -> JobConfig:
    # Two stages, two microbatches of 4 samples per step.
    settings = {"stages": 2, "microbatch_size": 4, "target_batch_size": 8, "steps": 3}
    return make_job(tmp_path, training=settings | training, runtime={"lease_timeout_s": LEASE_S})


class Harness:
    """A coordinator over a `FakeSwarm`, with the step records and rollbacks it announced."""

    def __init__(self, job: JobConfig, swarm: FakeSwarm, **kwargs: Any) -> None:
        self.job, self.swarm, self.clock = job, swarm, FakeClock()
        self.steps: asyncio.Queue[StepRecord] = asyncio.Queue()
        self.rollbacks: asyncio.Queue[int] = asyncio.Queue()
        self.statuses: list[str] = []  # what it said for `swarm status`, unless a test listens
        kwargs.setdefault("on_status", self.statuses.append)
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
            holders[stage] = (at or {}).get(stage) or self.coordinator.replicas()[stage][0].peer
        return await self.land(task.step, task.index, holders, trainer, report)

    async def land(
        self,
        step: int,
        index: int,
        holders: dict[int, str],
        trainer: str = "t",
        report: bool = True,
    ) -> MicrobatchResult:
        """Microbatch `index`'s gradients land at `holders` (stage -> peer), and the trainer
        reports them (with the loss where the last stage is among them)."""
        for peer in holders.values():
            self.swarm[peer].accumulate(index)
        last = self.job.training.stages - 1
        loss = 1.0 if last in holders else None
        result = MicrobatchResult(step, index, holders, loss, 4)
        if report:
            await self.coordinator.report(trainer, result)
        return result

    async def step(self, at: dict[int, str] | None = None) -> StepRecord:
        """Train one whole step; returns its record once committed and its checkpoint (written
        in the background) sealed or skipped."""
        for task in await self.lease():
            await self.run(task, at)
        record = await within(self.steps.get(), 10)
        await within(self.coordinator.flush(), 10)
        return record

    async def replayed(self, at: dict[int, str], trainer: str = "t") -> StepRecord:
        """Run what the coordinator gives out (on the peers `at` names) until a step commits,
        as trainers replay what voids and drops give back; that step's record. A job that
        failed meanwhile fails the test with its error."""
        for _ in range(400):
            if not self.steps.empty() or self.coordinator.error is not None:
                break
            for task in (await self.coordinator.lease(trainer, 8)).tasks:
                await self.run(task, at, trainer=trainer)
            await asyncio.sleep(0.05)
        assert self.coordinator.error is None, self.coordinator.error
        return await within(self.steps.get(), 15)


class MakeHarness(Protocol):
    def __call__(self, job: JobConfig, swarm: FakeSwarm, **kwargs: Any) -> Harness: ...


@pytest.fixture
async def make_harness() -> AsyncIterator[MakeHarness]:
    """`make_harness(job, swarm, **coordinator_kwargs)`: a `Harness`, its coordinator closed after
    the test."""
    made: list[Harness] = []

    def make(job: JobConfig, swarm: FakeSwarm, **kwargs: Any) -> Harness:
        made.append(Harness(job, swarm, **kwargs))
        return made[-1]

    yield make
    for h in made:
        await h.coordinator.close()


async def started(
    tmp_path: Path, make_harness: MakeHarness, *stages: str, **training: Any
) -> Harness:
    """A harness of a two-stage job (`job_of` with `training`), its coordinator started over
    fake replicas: stage 0's peers the first of `stages` names, space-separated ("a"), stage
    1's the second ("c d")."""
    job = job_of(tmp_path, **training)
    swarm = FakeSwarm(fingerprint(job), 2)
    for stage, peers in enumerate(stages):
        for peer in peers.split():
            swarm.add(stage, peer)
    h = make_harness(job, swarm)
    await h.coordinator.start()
    return h


def until(condition: Callable[[], object], what: str = "the condition") -> Awaitable[object]:
    """`wait_until` at the harness's pace: asked every millisecond (a state it passes through is
    seen), for 5 s."""
    return wait_until(condition, what, timeout_s=5.0, every_s=0.001)
