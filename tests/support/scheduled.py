"""A scheduler in the test's process with its embedded trainer, the embedded broker, and stage
servers that join through it as `swarm stage-server --broker` does (a `PeerAgent` over a real gRPC
server and its own bus connection), all in this process: what `swarm status` shows can be read at
any moment, and a peer can be killed (its last-will published) and restarted under its id. A job
that outlasts the test (`LONG_SPEC`); amqtt's leaked sockets let be (`AMQTT_LEAKS`)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from scheduler.job_api import job_status
from scheduler.service import Scheduler, SchedulerOptions
from scheduler.store import JobStore
from stage_server.agent import PeerAgent
from stage_server.peer.limits import PeerLimits
from stage_server.server import RunningStageServer, StageServerOptions, start_grpc
from swarm.bus.broker import EmbeddedBroker
from swarm.bus.connection import Bus, BusSettings, Subscription
from swarm.bus.topics import SCHEDULER_USER, Topics
from swarm.deadline import within
from swarm.job.config import RuntimeConfig
from swarm.proto import control_pb2 as cpb
from swarm.proto import scheduler_pb2 as spb
from tests.support.jobs import BASE, render
from tests.support.waiting import wait_until

__all__ = ["AMQTT_LEAKS", "LONG_SPEC", "Peer", "ScheduledSwarm", "scheduled_swarm"]

WAIT_S = 60.0  # a join under load may take many steps: copies are admitted between commits
CANCEL_WAIT_S = 60.0
"""How long the teardown waits for a cancelled job's task to end before it fails the test."""
LONG_SPEC = render({**BASE, "training": {**BASE["training"], "stages": 2, "steps": 100_000}})
"""Two stages, and steps enough to outlast the test (it is cancelled at the end)."""
AMQTT_LEAKS = pytest.mark.filterwarnings("ignore::ResourceWarning")
"""amqtt's broker leaks a socket now and then (tests/system/test_job_end.py says when): the garbage
collector may find it during any test, and it is not ours to fail on."""
FAST = BusSettings(keepalive_s=2, operation_timeout_s=3.0, close_timeout_s=4.0)


@dataclass
class Peer:
    """One stage server under the scheduler."""

    name: str
    running: RunningStageServer
    bus: Bus
    agent: PeerAgent
    task: asyncio.Task[None]
    stop: asyncio.Event = field(default_factory=asyncio.Event)


def _bus(url: str, client: str, user: str, will: tuple[str, cpb.PeerAnnouncement] | None) -> Bus:
    return Bus(url, client, username=user, will=will, registry=CollectorRegistry(), settings=FAST)


class ScheduledSwarm:
    def __init__(self, broker: EmbeddedBroker, store: JobStore, scheduler: Scheduler) -> None:
        self.broker, self.store, self.scheduler = broker, store, scheduler
        self.peers: dict[str, Peer] = {}
        self.topics = Topics()

    async def start_job(
        self, spec: str, base_dir: Path, peers: tuple[str, ...] = ("a", "b")
    ) -> str:
        """Submit `spec` (steps enough to outlast the test: it is cancelled at the end), start
        `peers` and return the job's id once it has committed two steps."""
        job = self.store.create("test", spec, str(base_dir), 100_000).id
        self.scheduler.submitted(job)
        for name in peers:
            await self.add(name)
        await wait_until(lambda: self.step(job) >= 2, "the job trains", timeout_s=WAIT_S)
        return job

    def step(self, job_id: str) -> int:
        record = self.store.get(job_id)
        return record.step if record else 0

    @contextlib.asynccontextmanager
    async def reader(self) -> AsyncIterator[Subscription]:
        """Everything published from now on (and what is retained), as the scheduler sees it."""
        async with _bus(self.broker.url, "reader", SCHEDULER_USER, None) as bus:
            await bus.wait_connected(WAIT_S)
            sub = bus.subscribe(self.topics.everything())
            await sub.wait_subscribed(WAIT_S)
            yield sub

    async def add(
        self,
        name: str,
        announce_host: str = "",
        throttle: float = 1.0,
        host: str = "",
        limits: PeerLimits | None = None,
    ) -> Peer:
        """Start stage server `name`; `announce_host`: the host it tells others to dial (one
        where it does not listen makes a peer nobody can reach); `throttle`: `--throttle`;
        `host`: the host id it announces (default: its name, a machine of its own, as on a
        real swarm; peers of one host id share a failure domain); `limits`: its own flags."""
        opts = StageServerOptions(
            stage=0, peer=name, announce_host=announce_host, limits=limits or PeerLimits()
        )
        running = await start_grpc(opts, RuntimeConfig().max_message_bytes, throttle)
        will = cpb.PeerAnnouncement(peer=name, state=cpb.PEER_STATE_OFFLINE)
        bus = _bus(self.broker.url, f"peer-{name}", name, (self.topics.peer(name), will))
        await bus.__aenter__()
        await bus.wait_connected(WAIT_S)
        agent = PeerAgent(
            running,
            bus,
            peer=name,
            device="cpu",
            throttle=throttle,
            host=host or name,
            limits=opts.limits,
        )
        agent.load_period_s = 0.2
        stop = asyncio.Event()
        peer = Peer(name, running, bus, agent, asyncio.create_task(agent.run(stop)), stop)
        self.peers[name] = peer
        return peer

    async def kill(self, name: str) -> None:
        """`name` dies: no goodbye; the broker's last-will for it (offline, no time) goes out."""
        peer = self.peers.pop(name)
        peer.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await peer.task
        await peer.running.stop()
        with contextlib.suppress(Exception):
            await peer.bus.__aexit__(None, None, None)
        will = cpb.PeerAnnouncement(peer=name, state=cpb.PEER_STATE_OFFLINE)
        await self.scheduler.bus.publish(self.topics.peer(name), will, retain=True)

    def status(self, job_id: str) -> spb.JobStatus:
        """The job as `swarm status` gets it (GetJob's answer, with its events)."""
        record = self.store.get(job_id)
        assert record is not None
        return job_status(record, self.scheduler, self.store.events(job_id, 50))

    async def close(self) -> None:
        for name in list(self.peers):
            peer = self.peers.pop(name)
            peer.stop.set()
            with contextlib.suppress(Exception):
                await within(peer.task, 10)
            await peer.running.stop()
            with contextlib.suppress(Exception):
                await peer.bus.__aexit__(None, None, None)


@contextlib.asynccontextmanager
async def scheduled_swarm(tmp_path: Path, **options: object) -> AsyncIterator[ScheduledSwarm]:
    """A running scheduler (`options`: its `SchedulerOptions`, fast placement by default) over
    the embedded broker, with no peers yet; peers measure into a cache under `tmp_path`."""
    cache = os.environ.get("SWARM_CACHE_DIR")
    os.environ["SWARM_CACHE_DIR"] = str(tmp_path / "cache")
    try:
        async with _scheduled(tmp_path, options) as swarm:
            yield swarm
    finally:
        if cache is None:
            os.environ.pop("SWARM_CACHE_DIR", None)
        else:
            os.environ["SWARM_CACHE_DIR"] = cache


def _outlived(tasks: set[asyncio.Task[None]]) -> str:
    """What each cancelled job's task was awaiting when the teardown's wait ran out: its chain of
    awaits, innermost last (a task's own stack stops at its outermost coroutine)."""
    said = [f"{len(tasks)} cancelled job task(s) still ran {CANCEL_WAIT_S:g} s on:"]
    for task in tasks:
        said.append(f"{task.get_name()}:")
        awaited: object = task.get_coro()
        while frame := getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None):
            said.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
        if awaited is not None:
            said.append(f"  awaiting {awaited!r}")
    return "\n".join(said)


@contextlib.asynccontextmanager
async def _scheduled(tmp_path: Path, options: dict[str, object]) -> AsyncIterator[ScheduledSwarm]:
    settings: dict[str, object] = {"placement_grace_s": 0.2, "retry_pause_s": 0.2}
    settings |= {"dial_private": True} | options  # its peers are on loopback
    async with EmbeddedBroker() as broker:
        with JobStore(tmp_path / "jobs.sqlite") as store:
            async with _bus(broker.url, "scheduler", SCHEDULER_USER, None) as bus:
                await bus.wait_connected(WAIT_S)
                opts = SchedulerOptions(tmp_path / "ckpt", **settings)  # type: ignore[arg-type]
                scheduler = Scheduler(store, bus, opts)
                stop = asyncio.Event()
                running = asyncio.create_task(scheduler.run(stop))
                swarm = ScheduledSwarm(broker, store, scheduler)
                try:
                    yield swarm
                finally:
                    for job in store.list():
                        if not job.finished:
                            store.set_state(job.id, "cancelled", message="test over")
                            scheduler.cancelled(job.id)
                    tasks = list(scheduler._tasks.values())
                    outlived = ""  # their stacks, read before the scheduler's stop cancels them
                    if tasks:  # the jobs' trainers stop before the peers they call
                        _, running_on = await asyncio.wait(tasks, timeout=CANCEL_WAIT_S)
                        outlived = _outlived(running_on) if running_on else ""
                    await swarm.close()
                    stop.set()
                    async with asyncio.timeout(WAIT_S):
                        await running
                    if outlived:  # a product fault: a cancelled job must stop, not time out
                        raise AssertionError(outlived)
    # amqtt's broker leaks a socket when a client's UNSUBSCRIBE and DISCONNECT arrive together
    # (tests/system/test_job_end.py): collected here, not in whichever later test gc runs in.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
