"""A swarm whose stage servers run in the test's process (real gRPC servers on real ports), so
every replica's state can be looked at after each step, and its trainers in the same process
(`Swarm.train`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Container, Sequence

import pytest
import torch

from client.trainer import PipelineTrainer
from scheduler.coordinator import LocalCoordinator
from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.deadline import within
from swarm.job.config import JobConfig
from swarm.ops.poison import Poison
from swarm.rpc.lease import Lease, Replica, Working

__all__ = ["Swarm", "lease_after_joined", "make_swarm"]

CLOSE_GRACE_S = 1.0  # for the calls in flight when a test's swarm is closed


def lease_after_joined(
    coordinator: LocalCoordinator,
    joined: Sequence[RunningStageServer],
    step: int,
    timeout_s: float = 60.0,
    banned: Container[str] = (),
) -> None:
    """Hold `coordinator`'s leases of step `step` on until the replica in `joined` (added
    mid-job) is a member, at most `timeout_s`. Its copy runs while training goes on and
    nothing bounds how many steps it takes (under load, more than a short job has): a test
    that wants the joiner to work waits for its admission instead of racing the job's end
    (one in `banned` is no member any more, and was: nothing to wait for)."""
    lease = coordinator.lease

    def member() -> bool:
        return bool(joined) and (
            joined[0].address in coordinator.membership.synced or joined[0].address in banned
        )

    async def held(
        trainer: str, count: int, *, wait_s: float = 0.0, working: Sequence[Working] = ()
    ) -> Lease:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (ledger := coordinator.ledger) is not None and ledger.step >= step and not member():
            assert loop.time() < deadline, f"no member {timeout_s}s after step {step} opened"
            await asyncio.sleep(0.02)
        return await lease(trainer, count, wait_s=wait_s, working=working)

    coordinator.lease = held  # type: ignore[method-assign]


class Swarm:
    """Stage servers in this process, grouped per stage, and a coordinator over them."""

    def __init__(self, job: JobConfig) -> None:
        self.job = job
        self.servers: list[list[RunningStageServer]] = [[] for _ in range(job.training.stages)]

    async def add(self, stage: int, poison: Poison | None = None) -> RunningStageServer:
        """A replica of `stage`; `poison`: the lies it tells, armed at its start."""
        server = await start_stage_server(self.job, StageServerOptions(stage=stage, poison=poison))
        self.servers[stage].append(server)
        return server

    async def add_replicas(self, count: int, last: Poison | None = None) -> None:
        """`count` replicas of every stage, stage by stage; the last of each lies as `last`
        says (armed at its start), where given."""
        for stage in range(self.job.training.stages):
            for k in range(count):
                await self.add(stage, last if k == count - 1 else None)

    def members(self) -> list[list[Replica]]:
        return [[Replica(s.address, s.address, 1.0) for s in stage] for stage in self.servers]

    def assert_replicas_identical(self) -> None:
        for stage in self.servers:
            first = stage[0].runtime
            for other in stage[1:]:
                assert other.runtime.step == first.step
                for (name, a), b in zip(
                    first.export_state().items(), other.runtime.export_state().values(), strict=True
                ):
                    assert torch.equal(a, b), f"stage {first.stage} differs at {name}"

    async def train(
        self, coordinator: LocalCoordinator, trainers: int = 1, *, seeded: bool = True
    ) -> None:
        """Start `coordinator` and run `trainers` trainers over it (wiring seeded 0, 1, ..., or
        from the OS as a trainer's is by default) until the job's last step is committed; the
        job must end without an error."""
        runs = [
            PipelineTrainer(self.job, coordinator, seed=i if seeded else None)
            for i in range(trainers)
        ]
        try:
            await coordinator.start()
            await within(asyncio.gather(*(t.run() for t in runs), coordinator.finished.wait()), 120)
            assert coordinator.error is None
        finally:
            for t in runs:
                await t.close()

    async def close(self) -> None:
        """Every server stopped at the test's end. A call still in flight then (a step the
        test's cancelled training left) has `CLOSE_GRACE_S`, not a server's 10 s: the test is
        over, nothing waits for its answer."""
        for stage in self.servers:
            for s in stage:
                s.grace_s = min(s.grace_s, CLOSE_GRACE_S)
                await s.stop()


@pytest.fixture
async def make_swarm() -> AsyncIterator[list[Swarm]]:
    """Append the `Swarm`s a test makes: each is closed after the test."""
    made: list[Swarm] = []
    yield made
    for swarm in made:
        await swarm.close()
