"""Which attempt's start waits for the holders of the job's trained step
(`scheduler.coordinator.holders`): a scheduler run's first, whose peers come back one by one
after its restart; not a later one, which placement has waited for already
(`--lost-stage-grace-s` once, not twice, before a lost stage's rollback); and a job ended and
forgotten leaves nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

from scheduler.coordinator.coordinator import LocalCoordinator
from scheduler.store import JobStore
from tests.support.inprocess import Swarm
from tests.support.job_training import Assignments, job_training
from tests.support.jobs import make_job
from tests.support.waiting import wait_until


async def test_only_a_runs_first_attempt_waits_for_the_holders(
    tmp_path: Path, make_swarm: list[Swarm], monkeypatch: pytest.MonkeyPatch
) -> None:
    job = make_job(tmp_path, training={"stages": 2, "steps": 400}, rebalance={"enabled": False})
    swarm = Swarm(job)
    make_swarm.append(swarm)
    starts: list[tuple[int | None, float]] = []
    real = LocalCoordinator.start

    async def start(self: LocalCoordinator, recorded: int | None, wait_s: float) -> int:
        starts.append((recorded, wait_s))
        return await real(self, recorded, wait_s)

    monkeypatch.setattr(LocalCoordinator, "start", start)

    async def set_status(job_id: str, state: Any, text: str) -> None:
        pass

    with JobStore(tmp_path / "jobs.sqlite") as store:
        job_id = store.create(swarm.job.name, "", str(tmp_path), 400).id
        for stage in range(2):
            server = await swarm.add(stage)
            server.servicer.serve(server.runtime, job_id)  # as the scheduler assigned
        training = job_training(store, swarm, tmp_path / "ckpt", set_status)

        async def attempt() -> None:
            run = asyncio.create_task(training.run(job_id, swarm.job, []))
            await wait_until(lambda: training.coordinators.get(job_id), "its coordinator")
            run.cancel()  # as a lost stage ends an attempt
            with contextlib.suppress(asyncio.CancelledError):
                await run

        await attempt()
        await attempt()
        training.forget(job_id)  # the job ended
        await attempt()
    grace = Assignments.lost_stage_grace_s
    assert [wait for _, wait in starts] == [grace, 0.0, grace]
    assert all(recorded is not None for recorded, _ in starts)
