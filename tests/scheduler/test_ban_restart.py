"""A ban outlives the scheduler (issue 55, item 2). A peer banned in a job is kept in the job
store, and the job's coordinator built again from that store, as a restarted scheduler resumes
the job, starts with it banned: no member (the peer registry still lists it), so it takes no
step, and the rollback that took its work away is not run again."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

from scheduler.job_training import JobTraining
from scheduler.store import JobStore
from tests.support.inprocess import Swarm
from tests.support.job_training import job_training
from tests.support.jobs import make_job
from tests.support.waiting import wait_until


async def _stop(run: asyncio.Task[None]) -> None:
    """What a scheduler stopping does to a job's training: cancel it (its `finally` closes)."""
    run.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await run


@pytest.mark.attack("P-return")
async def test_a_banned_peer_stays_banned_when_the_scheduler_restarts(
    tmp_path: Path, make_swarm: list[Swarm]
) -> None:
    training = {"stages": 2, "steps": 400, "target_batch_size": 4, "checkpoint_every": 2}
    job = make_job(tmp_path, training=training, rebalance={"enabled": False})
    swarm = Swarm(job)
    make_swarm.append(swarm)
    said: list[str] = []

    async def set_status(job_id: str, state: Any, text: str) -> None:
        said.append(text)

    def trained(store: JobStore, job_id: str, steps: int) -> bool:
        record = store.get(job_id)
        return record is not None and record.step >= steps

    async def coordinator_of(training: JobTraining, job_id: str) -> Any:
        return await wait_until(lambda: training.coordinators.get(job_id), "its coordinator")

    path, checkpoints = tmp_path / "jobs.sqlite", tmp_path / "ckpt"
    with JobStore(path) as store:
        job_id = store.create(job.name, "", str(tmp_path), job.training.steps).id
        for stage in range(job.training.stages):
            for _ in range(2):
                server = await swarm.add(stage)
                server.servicer.serve(server.runtime, job_id)  # as the scheduler assigned it
        liar = swarm.servers[1][1]
        first = job_training(store, swarm, checkpoints, set_status)
        run = asyncio.create_task(first.run(job_id, job, []))
        try:
            coordinator = await coordinator_of(first, job_id)
            await wait_until(lambda: trained(store, job_id, 3), "three steps")
            step = store.get(job_id).step  # type: ignore[union-attr]
            await coordinator.bans.ban(liar.address, 1, "its outputs differ", step)
            await wait_until(
                lambda: [e for e in store.events(job_id) if e.kind == "rollback"], "its rollback"
            )
            await wait_until(lambda: trained(store, job_id, 2), "a step after the rollback")
        finally:
            await _stop(run)
        (kept,) = store.bans(job_id)  # kept when it was made, and its rollback done
        assert (kept.peer, kept.stage, kept.replayed) == (liar.address, 1, True)
        assert "its outputs differ" in kept.reason
    held = liar.runtime.step  # where the ban left it

    with JobStore(path) as store:  # the scheduler restarted: the store read anew from its file
        events = len(store.events(job_id))
        again = job_training(store, swarm, checkpoints, set_status)
        run = asyncio.create_task(again.run(job_id, job, []))
        try:
            coordinator = await coordinator_of(again, job_id)
            start = store.get(job_id).step  # type: ignore[union-attr]
            await wait_until(lambda: trained(store, job_id, start + 4), "four steps more")
            assert liar.address in coordinator.bans.banned, "the ban was forgotten"
            assert liar.address not in [r.peer for r in coordinator.replicas()[1]]
            assert liar.runtime.step == held, "the banned peer took steps again"
        finally:
            await _stop(run)
        # Not banned anew, nor its rollback run again.
        later = store.events(job_id)[events:]
        assert [e for e in later if e.kind in ("ban", "rollback")] == [], later
        assert coordinator.metrics.rollbacks._value.get() == 0
        assert [b.peer for b in store.bans(job_id)] == [liar.address]
