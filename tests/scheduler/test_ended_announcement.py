"""An ended job's retained announcement holds no spec (issue 44, N11): a loop of submit and cancel
left each job's whole spec (up to 1 MiB) retained in the embedded broker for `finished_retain_s`.
Only stage servers read announcements, and an ended job's spec is nothing to them (they drop the
job); trainers read the spec from the job API."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from swarm.bus.topics import Topics
from swarm.proto import control_pb2 as cpb
from tests.support.jobs import write_job
from tests.support.scheduled import WAIT_S, scheduled_swarm

pytestmark = pytest.mark.timeout(120)


def _retained(swarm: object, topic: str) -> cpb.JobAnnouncement | None:
    broker = swarm.broker._broker  # type: ignore[attr-defined]
    held = broker.retained_messages.get(topic)
    return None if held is None else cpb.JobAnnouncement.FromString(bytes(held.data))


@pytest.mark.attack("N11")
async def test_a_cancelled_jobs_announcement_drops_its_spec(tmp_path: Path) -> None:
    spec = write_job(tmp_path, "big").read_text() + "\n# " + "x" * 200_000 + "\n"
    topic_of = Topics().job
    async with scheduled_swarm(tmp_path) as swarm:
        job = swarm.store.create("big", spec, str(tmp_path), 100).id
        swarm.scheduler.submitted(job)
        async with asyncio.timeout(WAIT_S):  # announced queued, with its spec for the peers
            while (held := _retained(swarm, topic_of(job))) is None or not held.spec:
                await asyncio.sleep(0.05)
        swarm.store.set_state(job, "cancelled", message="cancelled on request")  # as CancelJob
        swarm.scheduler.cancelled(job)
        async with asyncio.timeout(WAIT_S):
            while (held := _retained(swarm, topic_of(job))) is None or (
                held.state != cpb.JOB_STATE_CANCELLED
            ):
                await asyncio.sleep(0.05)
        assert held.spec == "", f"{len(held.spec)} bytes of spec retained for an ended job"
        assert held.name == "big" and held.job == job  # the rest of it still said
