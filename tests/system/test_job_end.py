"""What the scheduler lets go of when a job ends (a real broker, the embedded one): its retained
assignments at once (those of an earlier scheduler run too), its steps after
`finished_retain_s`, its announcement once newer jobs' ends push it out
(`scheduler.ended_announcements`: here the newest 2 stay), and its per-job state; the job's
record stays in the store."""

from __future__ import annotations

import asyncio
import gc
import warnings
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from scheduler import ended_announcements
from scheduler.service import Scheduler, SchedulerOptions
from scheduler.store import JobStore
from swarm.bus.broker import EmbeddedBroker
from swarm.bus.connection import Bus, BusSettings
from swarm.bus.topics import SCHEDULER_USER, Topics
from swarm.proto import control_pb2 as pb
from tests.support.jobs import BASE, render

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0
FAST = BusSettings(keepalive_s=2, operation_timeout_s=3.0, close_timeout_s=4.0)
JOBS = 3
KEPT = 2  # the newest ended jobs whose announcements stay retained


async def _retained(url: str, pattern: str) -> set[str]:
    """The topics holding a retained message on `pattern` (a fresh client's view)."""
    async with Bus(url, "late-reader", registry=CollectorRegistry(), settings=FAST) as reader:
        await reader.wait_connected(WAIT_S)
        sub = reader.subscribe(pattern)
        await sub.wait_subscribed(WAIT_S)
        found: set[str] = set()
        while True:
            try:
                async with asyncio.timeout(0.5):
                    topic, _ = await anext(sub)
            except TimeoutError:
                return found
            found.add(topic)


@pytest.mark.slow
# amqtt's broker leaks a connection's socket when a client's UNSUBSCRIBE and DISCONNECT arrive
# together (this test's short-lived readers do that); the garbage collector may find it at any
# moment of the test, so its ResourceWarning is not ours to fail on. It is collected below rather
# than in whichever later test the collector happens to run.
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_an_ended_job_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ended_announcements, "KEPT", KEPT)
    try:
        await _an_ended_job_leaves_nothing_behind(tmp_path)
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


async def _an_ended_job_leaves_nothing_behind(tmp_path: Path) -> None:
    topics = Topics()
    async with EmbeddedBroker() as broker:
        with JobStore(tmp_path / "jobs.sqlite") as store:
            ids = [store.create("test", render(BASE), str(tmp_path), 3).id for _ in range(JOBS)]
            async with Bus(
                broker.url, "scheduler", username=SCHEDULER_USER, registry=CollectorRegistry()
            ) as bus:
                await bus.wait_connected(WAIT_S)
                for job_id in ids:  # what an earlier scheduler run assigned to a peer now gone
                    old = pb.Assignment(job=job_id, peer="gone", stage=0, generation=1)
                    await bus.publish(topics.assign(job_id, "gone"), old, retain=True)
                opts = SchedulerOptions(tmp_path / "ckpt", finished_retain_s=3.0)
                scheduler = Scheduler(store, bus, opts)
                stop = asyncio.Event()
                running = asyncio.create_task(scheduler.run(stop))
                try:
                    async with asyncio.timeout(WAIT_S):  # each job is announced, placing
                        while len(await _retained(broker.url, topics.job("+"))) < JOBS:
                            pass
                    for job_id in ids:  # as the job API cancels
                        store.set_state(job_id, "cancelled", message="cancelled on request")
                        scheduler.cancelled(job_id)
                    # at once: the assignments are gone, the announcements (cancelled) stay
                    async with asyncio.timeout(WAIT_S):
                        while await _retained(broker.url, topics.assign("+", "+")):
                            pass
                    # the newest ended jobs' announcements (cancelled) stay; older ones go
                    kept = {topics.job(job_id) for job_id in ids[-KEPT:]}
                    async with asyncio.timeout(WAIT_S):
                        while await _retained(broker.url, topics.job("+")) != kept:
                            pass
                    await asyncio.sleep(opts.finished_retain_s)  # past it now
                    # and only they: a peer away at their end learns it as it reconnects
                    assert await _retained(broker.url, topics.everything()) == kept
                    assert not scheduler._user_cancelled and not scheduler._speed
                    assert not scheduler.snapshot and not scheduler._tasks
                    jobs = [t for t in bus._retained if t.startswith(f"{topics.prefix}jobs/")]
                    assert set(jobs) == kept
                    assert [r.state for r in store.list()] == ["cancelled"] * JOBS
                finally:
                    stop.set()
                    async with asyncio.timeout(WAIT_S):
                        await running
