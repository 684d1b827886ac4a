"""The scheduler's answers without a running job: leases of finished jobs, unplaceable peers.
A real store; no bus (these paths never publish)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from scheduler.service import Scheduler, SchedulerOptions
from scheduler.store import JobState, JobStore
from swarm.errors import FailedPrecondition
from swarm.proto import control_pb2 as cpb
from swarm.topics import Topics
from tests.jobs import BASE, render


class _NoBus:
    topics = Topics()


def _scheduler(store: JobStore, tmp_path: Path) -> Scheduler:
    return Scheduler(store, _NoBus(), SchedulerOptions(tmp_path / "ckpt"))  # type: ignore[arg-type]


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


def test_peers_with_unusable_speeds_are_not_placed(tmp_path: Path) -> None:
    with JobStore(tmp_path / "jobs.sqlite") as store:
        scheduler = _scheduler(store, tmp_path)
        for peer, speeds in {
            "good": [1.0, 2.0],
            "nan": [math.nan, 1.0],
            "negative": [-1.0, 1.0],
            "idle": [0.0, 0.0],
            "inf": [math.inf, 1.0],
            "half": [0.0, 3.0],
        }.items():
            scheduler.peers[peer] = cpb.PeerAnnouncement(
                peer=peer,
                state=cpb.PEER_STATE_JOINING,
                job="j",
                samples_per_second=dict(enumerate(speeds)),
            )
        assert scheduler._available("j", 2) == {"good": [1.0, 2.0], "half": [0.0, 3.0]}


def test_a_job_submitted_before_the_scheduler_runs_waits_in_the_store(tmp_path: Path) -> None:
    with JobStore(tmp_path / "jobs.sqlite") as store:
        job_id = store.create("test", render(BASE), str(tmp_path), 3).id
        scheduler = _scheduler(store, tmp_path)
        scheduler.submitted(job_id)  # the job API may answer before `run` starts
        assert scheduler._tasks == {}
        assert [r.id for r in store.unfinished()] == [job_id]  # `run` starts it from here
