"""The scheduler's answers without a running job: leases of finished jobs, a job submitted before
it runs. A real store; no bus (these paths never publish). Unplaceable peers: test_registry."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.service import Scheduler, SchedulerOptions
from scheduler.store import JobState, JobStore
from swarm.errors import FailedPrecondition
from tests.support.fakes import NoBus
from tests.support.jobs import BASE, render


def _scheduler(store: JobStore, tmp_path: Path) -> Scheduler:
    return Scheduler(store, NoBus(), SchedulerOptions(tmp_path / "ckpt"))  # type: ignore[arg-type]


@pytest.mark.parametrize("state", ["succeeded", "failed", "cancelled", "queued"])
async def test_a_lease_on_a_job_without_a_coordinator(tmp_path: Path, state: JobState) -> None:
    with JobStore(tmp_path / "jobs.sqlite") as store:
        job_id = store.create("test", render(BASE), str(tmp_path), 3).id
        for step in ("placing", "running", state) if state != "queued" else ():
            store.set_state(job_id, step)  # type: ignore[arg-type]
        scheduler = _scheduler(store, tmp_path)
        if state in ("failed", "cancelled"):
            with pytest.raises(FailedPrecondition, match=f"is {state}"):
                await scheduler.lease(job_id, "t", 4)
            return
        lease = await scheduler.lease(job_id, "t", 4)
    # A finished job tells trainers to stop; one not started yet, to ask again.
    assert lease.done is (state == "succeeded") and lease.tasks == []


def test_a_job_submitted_before_the_scheduler_runs_waits_in_the_store(tmp_path: Path) -> None:
    with JobStore(tmp_path / "jobs.sqlite") as store:
        job_id = store.create("test", render(BASE), str(tmp_path), 3).id
        scheduler = _scheduler(store, tmp_path)
        scheduler.submitted(job_id)  # the job API may answer before `run` starts
        assert scheduler._tasks == {}
        assert [r.id for r in store.unfinished()] == [job_id]  # `run` starts it from here
