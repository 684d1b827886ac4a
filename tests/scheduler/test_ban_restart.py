"""A ban outlives the scheduler (issue 55, item 2). A peer banned in a job is kept in the job
store, and the job's coordinator built again from that store, as a restarted scheduler resumes
the job, starts with it banned: no member (the peer registry still lists it), so it takes no
step, and the rollback that took its work away is not run again; one the scheduler stopped
before runs then."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from scheduler.store import BanRow, JobStore
from tests.support.inprocess import Swarm
from tests.support.job_training import job_training
from tests.support.jobs import make_job
from tests.support.waiting import wait_until


class _Scheduler:
    """A job of two stages of two replicas in this process, trained by a `JobTraining` over the
    job store at `path`, as a scheduler's; `run` is one scheduler's life, from its store's file
    to its stop."""

    def __init__(self, tmp_path: Path, swarm: Swarm) -> None:
        self.swarm, self.job, self.tmp_path = swarm, swarm.job, tmp_path
        self.path, self.job_id = tmp_path / "jobs.sqlite", ""

    async def serve(self) -> None:
        with JobStore(self.path) as store:
            self.job_id = store.create(self.job.name, "", str(self.tmp_path), 400).id
        for stage in range(self.job.training.stages):
            for _ in range(2):
                server = await self.swarm.add(stage)
                server.servicer.serve(server.runtime, self.job_id)  # as the scheduler assigned

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[tuple[JobStore, Any]]:
        """The store, read anew from its file, and the job's coordinator once it trains; the
        training cancelled on the way out, as a scheduler's stop does."""

        async def set_status(job_id: str, state: Any, text: str) -> None:
            pass

        with JobStore(self.path) as store:
            training = job_training(store, self.swarm, self.tmp_path / "ckpt", set_status)
            run = asyncio.create_task(training.run(self.job_id, self.job, []))
            try:
                yield (
                    store,
                    await wait_until(
                        lambda: training.coordinators.get(self.job_id), "its coordinator"
                    ),
                )
            finally:
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await run

    async def trained(self, store: JobStore, steps: int) -> int:
        """The job's step once it is `steps` or more."""
        return await wait_until(
            lambda: (r := store.get(self.job_id)) is not None and r.step >= steps and r.step,
            f"{steps} steps",
        )

    def events(self, store: JobStore, kind: str) -> list[str]:
        return [e.text for e in store.events(self.job_id) if e.kind == kind]


@pytest.fixture
async def scheduler(tmp_path: Path, make_swarm: list[Swarm]) -> _Scheduler:
    training = {"stages": 2, "steps": 400, "target_batch_size": 4, "checkpoint_every": 2}
    swarm = Swarm(make_job(tmp_path, training=training, rebalance={"enabled": False}))
    make_swarm.append(swarm)
    made = _Scheduler(tmp_path, swarm)
    await made.serve()
    return made


@pytest.mark.attack("P-return")
async def test_a_banned_peer_stays_banned_when_the_scheduler_restarts(
    scheduler: _Scheduler,
) -> None:
    liar = scheduler.swarm.servers[1][1]
    async with scheduler.run() as (store, coordinator):
        step = await scheduler.trained(store, 3)
        await coordinator.bans.ban(liar.address, 1, "its outputs differ", step)
        await wait_until(lambda: scheduler.events(store, "rollback"), "its rollback")
        await scheduler.trained(store, 2)  # a step after the rollback
    with JobStore(scheduler.path) as store:
        (kept,) = store.bans(scheduler.job_id)  # kept when it was made, and its rollback done
        assert (kept.peer, kept.stage, kept.replayed) == (liar.address, 1, True)
        assert "its outputs differ" in kept.reason
        events = len(store.events(scheduler.job_id))
    held = liar.runtime.step  # where the ban left it

    async with scheduler.run() as (store, coordinator):  # the scheduler restarted
        start = store.get(scheduler.job_id).step  # type: ignore[union-attr]
        await scheduler.trained(store, start + 4)
        assert liar.address in coordinator.bans.banned, "the ban was forgotten"
        assert liar.address not in [r.peer for r in coordinator.replicas()[1]]
        assert liar.runtime.step == held, "the banned peer took steps again"
        # Not banned anew, nor its rollback run again.
        later = store.events(scheduler.job_id)[events:]
        assert [e for e in later if e.kind in ("ban", "rollback")] == [], later
        assert coordinator.metrics.rollbacks._value.get() == 0


async def test_a_ban_whose_rollback_never_ran_rolls_back_when_the_scheduler_restarts(
    scheduler: _Scheduler,
) -> None:
    """The scheduler stopped between a ban and its rollback (the ban kept, the replicas still
    holding its work): the restarted one rolls back before its first step, without it."""
    liar = scheduler.swarm.servers[1][1]
    async with scheduler.run() as (store, _):
        await scheduler.trained(store, 3)
    held = liar.runtime.step
    with JobStore(scheduler.path) as store:
        store.record_ban(scheduler.job_id, BanRow(liar.address, 1, held, 0, "its sums differ"))

    async with scheduler.run() as (store, coordinator):
        (rolled,) = await wait_until(lambda: scheduler.events(store, "rollback"), "its rollback")
        assert f"{liar.address} banned" in rolled, rolled
        await scheduler.trained(store, 2)
        assert liar.address not in [r.peer for r in coordinator.replicas()[1]]
        assert liar.runtime.step == held, "the banned peer took steps again"
        assert [b.replayed for b in store.bans(scheduler.job_id)] == [True]
