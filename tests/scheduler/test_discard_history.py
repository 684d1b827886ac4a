"""A stage that waits on a re-admission's Discard (`scheduler.coordinator.discards`) has no
member, so `swarm status` says it stalled; the job's history says why it neither resumes nor
rolls back yet, and when the wait is given up (the scheduler wires the Discards' words to it)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from scheduler.store import JobStore
from tests.support.inprocess import Swarm
from tests.support.job_training import job_training
from tests.support.jobs import make_job


async def test_a_discards_words_are_the_jobs_history(tmp_path: Path) -> None:
    job = make_job(tmp_path)

    async def set_status(job_id: str, state: object, text: str) -> None:
        pass

    text = "stage 1: c answers at step 3 but its discard got no answer (UNAVAILABLE): waits"
    with JobStore(tmp_path / "jobs.sqlite") as store:
        job_id = store.create(job.name, "", str(tmp_path), job.training.steps).id
        training = job_training(store, Swarm(job), tmp_path / "ckpt", set_status)
        told = SimpleNamespace(committed=None, rolled_back=None, status=None, banned=None)
        coordinator = training._coordinator(job_id, job, told, None)  # type: ignore[arg-type]
        try:
            for said in coordinator.membership.discards.said:
                said(1, "c", text)
        finally:
            await coordinator.close()
        assert [(e.kind, e.text) for e in store.events(job_id)] == [("readmit", text)]
