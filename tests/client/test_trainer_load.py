"""Trainers outside the scheduler follow the replicas' load reports: a remote trainer given the
broker merges what a peer publishes there into its wiring (the embedded amqtt broker, for real).
A peer's load topic is the same whatever job it serves: the trainer takes its own job's reports."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

import client.remote as remote
import client.trainer as trainer_module
from client.trainer import PipelineTrainer, load_followed
from swarm.bus.broker import EmbeddedBroker
from swarm.bus.connection import Bus
from swarm.proto import control_pb2 as cpb
from swarm.proto import scheduler_pb2 as spb
from swarm.rpc.lease import Replica
from tests.support.jobs import BASE, render

pytestmark = pytest.mark.timeout(60)

JOB = "j1"
QUEUE_DEPTH = 3  # microbatches queued at the replica, as it reports them
SECONDS_PER_SAMPLE = 0.5


class _Scheduler:
    """The job API as the remote trainer sees it: only the job's status is asked for here."""

    def __init__(self, address: str, job_id: str, **_: Any) -> None:
        self.job_id = job_id

    async def job(self) -> spb.JobStatus:
        return spb.JobStatus(job=self.job_id, name="test", steps=3, spec=render(BASE))

    async def fetch_data(self, validation: bool, offset: int = 0) -> AsyncIterator[bytes]:
        raise AssertionError("the job's data is generated, not a file: nothing to fetch")
        yield b""  # an async generator, as the real one

    async def close(self) -> None:
        pass


async def test_a_remote_trainer_follows_the_load_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    broker = EmbeddedBroker(port=0)
    await broker.start()
    seen: list[float] = []

    class Watching(PipelineTrainer):
        """Instead of training: replicas of stage 0 appear, and one publishes its load on the
        broker until this trainer's wiring has it, then its load for another job (ignored), then
        the other replica its load, for this job, behind it."""

        async def run(self) -> None:
            stages = self.job.training.stages
            replicas = [Replica(p, "127.0.0.1:1", 1.0) for p in ("p0", "p1")]
            self.sync([replicas] + [[] for _ in range(stages - 1)])
            pool = self.wiring[0]
            report = cpb.LoadReport(
                peer="p0",
                job=JOB,
                stage=0,
                queue_depth=QUEUE_DEPTH,
                ema_seconds_per_sample=SECONDS_PER_SAMPLE,
            )
            async with Bus(broker.url, "peer-p0", registry=CollectorRegistry()) as peer:
                await peer.wait_connected(10.0)
                async with asyncio.timeout(20.0):
                    while pool.queued("p0") == 0.0:  # the trainer may not be subscribed yet
                        await peer.publish(peer.topics.load("p0"), report)
                        await asyncio.sleep(0.05)
                    other = cpb.LoadReport(peer="p0", job="other", stage=0, queue_depth=99)
                    await peer.publish(peer.topics.load("p0"), other)
                    report.peer = "p1"  # an open broker: one connection may publish for both
                    while pool.queued("p1") == 0.0:  # so "other" was handled before it
                        await peer.publish(peer.topics.load("p1"), report)
                        await asyncio.sleep(0.05)
            seen.extend([pool.queued("p0"), pool.throughput("p0")])

    monkeypatch.setattr(remote, "RemoteCoordinator", _Scheduler)
    monkeypatch.setattr(remote, "PipelineTrainer", Watching)
    try:
        assert await remote.run_remote_trainer("127.0.0.1:1", JOB, broker=broker.url) == 0
    finally:
        await broker.stop()
    microbatch = BASE["training"]["microbatch_size"]
    assert seen == [QUEUE_DEPTH * microbatch, 1.0 / SECONDS_PER_SAMPLE]


async def test_without_a_broker_nothing_is_followed(monkeypatch: pytest.MonkeyPatch) -> None:
    """No broker (a standalone trainer's default): no bus, no follower, the block just runs."""
    made: list[tuple[Any, ...]] = []

    class NoBus:
        def __init__(self, *args: Any, **_: Any) -> None:
            made.append(args)

        async def __aenter__(self) -> NoBus:
            return self

        async def __aexit__(self, *_: object) -> None:
            pass

    monkeypatch.setattr(trainer_module, "Bus", NoBus)
    trainer = cast(PipelineTrainer, SimpleNamespace(trainer_id="t1", wiring=None, job=None))
    before, ran = asyncio.all_tasks(), False
    async with load_followed(None, JOB, [trainer]):
        assert asyncio.all_tasks() == before  # no follower started
        ran = True
    assert ran and made == []
