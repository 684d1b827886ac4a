"""What a stage server under a scheduler says it became (issue 30, items 5 and 9): a real stage
server (gRPC and /metrics on real ports) and its agent on a real broker, driven by the messages a
scheduler publishes through measure -> assign -> serve -> move -> release. At the default level its
log says each of those once, in one line, and nothing per step; its `swarm_peer_info` is one
series at every moment, saying what it does now. The same in real processes, to the job's end:
tests/system/test_discovery.py."""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from stage_server.agent import PeerAgent
from stage_server.cli import LIFECYCLE_LOGGERS, show_lifecycle
from stage_server.server import RunningStageServer, StageServerOptions, start_grpc
from swarm.bus.broker import EmbeddedBroker
from swarm.bus.connection import Bus, Subscription
from swarm.bus.topics import SCHEDULER_USER, Topics
from swarm.job.config import RuntimeConfig
from swarm.proto import control_pb2 as cpb
from tests.support.jobs import BASE, render

pytestmark = pytest.mark.timeout(60)

WAIT_S = 20.0
PEER, JOB = "p", "j-1"
SPEC = render({**BASE, "training": {**BASE["training"], "stages": 2}})


@pytest.fixture
def default_level() -> Iterator[None]:
    """Logging as `swarm stage-server` sets it up at the default level (WARNING)."""
    root = logging.getLogger()
    old = root.level
    root.setLevel(logging.WARNING)
    show_lifecycle()
    try:
        yield
    finally:
        root.setLevel(old)
        for name in LIFECYCLE_LOGGERS:
            logging.getLogger(name).setLevel(logging.NOTSET)


def _peer_info(running: RunningStageServer) -> list[dict[str, str]]:
    """The labels of every `swarm_peer_info` series the server's /metrics shows now."""
    url = f"http://127.0.0.1:{running.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return [
        dict(s.labels)
        for family in text_string_to_metric_families(text)
        if family.name == "swarm_peer_info"
        for s in family.samples
    ]


async def _until(
    announcements: Subscription, wanted: Callable[[cpb.PeerAnnouncement], bool]
) -> cpb.PeerAnnouncement:
    """The peer's next announcement that is `wanted` (each arrives after its metrics changed)."""
    async with asyncio.timeout(WAIT_S):
        async for _, message in announcements:
            assert isinstance(message, cpb.PeerAnnouncement)
            if wanted(message):
                return message
    raise AssertionError("the subscription ended")


@pytest.fixture
async def broker() -> AsyncIterator[EmbeddedBroker]:
    async with EmbeddedBroker() as b:
        yield b


async def test_a_peer_says_once_what_it_became_and_shows_it_in_one_series(
    broker: EmbeddedBroker,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    default_level: None,
) -> None:
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "cache"))
    topics = Topics()
    opts = StageServerOptions(stage=-1, peer=PEER, metrics_port=0)
    running = await start_grpc(opts, RuntimeConfig().max_message_bytes)
    states: list[str] = []

    def show(state: str, job: str, stage: str) -> None:  # one series, these labels
        series = _peer_info(running)
        # No scheduler dials it back here: how others reach it stays unknown, with no relay.
        path = {"reachability": "unknown", "relay": ""}
        expected = {"peer": PEER, "state": state, "job": job, "stage": stage, **path}
        assert series == [expected], series
        states.append(state)

    try:
        show("idle", "", "")  # before any bus: an idle peer is idle, not "joining"
        async with (
            Bus(broker.url, "sched", username=SCHEDULER_USER, registry=CollectorRegistry()) as sch,
            Bus(broker.url, f"peer-{PEER}", username=PEER, registry=CollectorRegistry()) as bus,
        ):
            await sch.wait_connected(WAIT_S)
            await bus.wait_connected(WAIT_S)
            announcements = sch.subscribe(topics.peer(PEER))
            await announcements.wait_subscribed(WAIT_S)
            agent = PeerAgent(
                running, bus, peer=PEER, device="cpu", metrics=running.servicer.metrics
            )
            stop = asyncio.Event()
            task = asyncio.create_task(agent.run(stop))
            await _until(announcements, lambda a: a.state == cpb.PEER_STATE_JOINING)
            show("idle", "", "")

            async def job(state: cpb.JobState) -> None:
                await sch.publish(
                    topics.job(JOB), cpb.JobAnnouncement(job=JOB, spec=SPEC, state=state), True
                )

            async def assign(stage: int) -> cpb.PeerAnnouncement:
                generation = time.time_ns() // 1000
                message = cpb.Assignment(job=JOB, peer=PEER, stage=stage, generation=generation)
                await sch.publish(topics.assign(JOB, PEER), message, retain=True)
                return await _until(
                    announcements, lambda a: a.state == cpb.PEER_STATE_SERVING and a.stage == stage
                )

            await job(cpb.JOB_STATE_PLACING)
            await _until(announcements, lambda a: len(a.samples_per_second) == 2)
            show("waiting", JOB, "")  # measured, waiting for a stage
            await assign(0)
            show("serving", JOB, "0")
            await assign(1)  # rebalancing moves it
            show("serving", JOB, "1")
            await job(cpb.JOB_STATE_CANCELLED)
            await _until(announcements, lambda a: a.job == "")
            show("idle", "", "")
            stop.set()
            await task
            show("offline", "", "")
    finally:
        await running.stop()

    said = [r.getMessage() for r in caplog.records if r.name.startswith("stage_server")]
    expected = [
        "measured samples/s per stage on cpu: {",  # its own cache: shared, says so (issue 45)
        f"{PEER}: measured for job {JOB}: samples/s per stage {{",
        f"{PEER}: assigned stage 0 of job {JOB} (layers 0..1 of 4); building it",
        f"{PEER}: serving stage 0 of job {JOB}",
        f"{PEER}: moving from stage 0 to stage 1 of job {JOB} (layers 2..3 of 4)",
        f"{PEER}: serving stage 1 of job {JOB}",
        f"{PEER}: released stage 1 of job {JOB}: it was cancelled; free for another",
        f"{PEER}: stopped (SIGTERM or SIGINT) while idle; announced offline",
    ]
    assert len(said) == len(expected), said  # one line each, nothing else at this level
    for line, start in zip(said, expected, strict=True):
        assert line.startswith(start), (line, start)
