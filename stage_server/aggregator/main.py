"""The aggregator peer (`swarm aggregator --broker URL`): a process with no model and no GPU that
owns averaging parts in the pools of the jobs it is offered.

In a round with aggregators the coordinator appends their PoolService addresses after the
replicas of the round's group; the first `contributors` members send their values of each part
to its owner, and an aggregator, owning a part, sums their contributions in member order and
answers the sum, exactly as a replica owns a part (`stage_server.averaging.owner`'s `Averager`,
served by `stage_server.averaging.service`'s `PoolServicer`). It contributes nothing and holds
nothing but the chunks of the parts it is sent: no model, no gradient, no optimizer state.

What it takes: `Reduce` calls carrying the swarm token, for a stage of a job whose announcement
(jobs/{job}) says it is running (`PoolJobs`); anything else is refused with the reason
(NOT_FOUND: the job unknown, ended, or the stage not one of it; UNIMPLEMENTED: any other
service). What it holds: the bodies of the calls it serves come from one receive budget of
`--max-memory-bytes` (`swarm.wire.budget`): a part past what is free is refused
RESOURCE_EXHAUSTED naming that flag, and the round is retried (without it, if it keeps failing).
How many chunks a member sends it at once is the butterfly's per-owner window, so an honest pool
holds little of it.

It announces itself on peers/{peer} (role AGGREGATOR, `address` its PoolService, its link rates:
`--bandwidth`'s, else measured from the streams of the rounds it serves and announced again as
they move, as a stage server's: `stage_server.peer.links`), with a last will OFFLINE;
SIGTERM/SIGINT stop it in order (announced offline, calls in flight given `shutdown_grace_s`).
Like a stage server it takes `SWARM_FAULTS=averaging@STEP`
(`swarm.ops.faults`): SIGKILLed mid-round, at the first contribution of that step's round.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from stage_server.aggregator.identity import add_info
from stage_server.averaging.owner import Averager
from stage_server.averaging.service import PoolServicer
from stage_server.peer.identity import cache_dir, persistent_peer_id
from stage_server.peer.limits import MESSAGE_HEADROOM, PeerLimits
from stage_server.peer.links import DIRECTIONS, LinkMeter, fill_rates, reannounce
from swarm.bus.connection import Bus, BusLike
from swarm.bus.topics import TopicKind, Topics
from swarm.errors import ConfigError, NotFound
from swarm.job.config import RuntimeConfig, parse_job
from swarm.net.addresses import announced_host, host_port
from swarm.net.tokens import add_port
from swarm.ops.faults import Point, maybe_die
from swarm.ops.lifecycle import install_signal_handlers, print_ready
from swarm.ops.metrics import serve_metrics
from swarm.proto import control_pb2 as cpb
from swarm.proto import pool_pb2, pool_pb2_grpc
from swarm.rpc.server_options import ServerLimits, grpc_server
from swarm.wire.budget import ReceiveBudget

__all__ = [
    "DEFAULT_MAX_MEMORY_BYTES",
    "AggregatorAgent",
    "AggregatorOptions",
    "PoolJobs",
    "RunningAggregator",
    "run_aggregator",
    "start_aggregator",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_MEMORY_BYTES = 1 << 30
POOL_SERVICE = "swarm.proto.PoolService"
# A stalled job runs on (a stage waits for a replica): its other stages still average.
_RUNNING = (cpb.JOB_STATE_RUNNING, cpb.JOB_STATE_STALLED)
_PEERS = PeerLimits()  # a stage server's defaults: its members send within them


@dataclass(frozen=True)
class AggregatorOptions:
    host: str = "127.0.0.1"  # the interface to listen on
    port: int = 0  # 0: any free port (printed in the ready line)
    announce_host: str = ""  # what others dial; "": `host`
    metrics_port: int | None = None  # None: no /metrics; 0: any free port
    metrics_token: str | None = None  # /metrics requires it (None: `token`)
    peer: str = ""  # "": persisted in the cache directory
    token: str | None = None  # swarm token every call must carry (None: open)
    max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES  # bodies of the calls held at once
    max_message_bytes: int = _PEERS.max_message_bytes  # one gRPC message received or sent
    max_concurrent_rpcs: int = _PEERS.max_concurrent_rpcs
    upload_bytes_per_second: float = 0.0  # announced link rates (0: not known)
    download_bytes_per_second: float = 0.0
    threads: int = 1  # torch threads for the sums
    shutdown_grace_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_memory_bytes < MESSAGE_HEADROOM:
            raise ConfigError(
                f"--max-memory-bytes {self.max_memory_bytes} is below {MESSAGE_HEADROOM}: no "
                "part's chunk would fit"
            )
        if self.max_message_bytes < MESSAGE_HEADROOM + _PEERS.min_chunk_bytes:
            raise ConfigError(f"--max-message-bytes {self.max_message_bytes} is too small")
        if self.max_concurrent_rpcs < 1:
            raise ConfigError("--max-concurrent-rpcs must be at least 1")
        rates = (self.upload_bytes_per_second, self.download_bytes_per_second)
        if not all(r >= 0.0 and r != float("inf") for r in rates):
            raise ConfigError(f"--bandwidth must be finite and not negative, got {rates}")


class PoolJobs:
    """The running jobs whose pools this aggregator takes parts in, from their announcements; a
    `Reduce` is routed to a stage of one of them or refused (NOT_FOUND, with the reason)."""

    def __init__(self, max_chunk_bytes: int = _PEERS.max_chunk_bytes) -> None:
        self._max_chunk = max_chunk_bytes
        # job -> (its spec, its [runtime], its number of stages)
        self._running: dict[str, tuple[str, RuntimeConfig, int]] = {}
        self._ended: dict[str, str] = {}  # job -> why its calls are refused (the last 256)
        self._bad: dict[str, str] = {}  # job -> its spec that did not parse (said once)
        # job -> the key of the scheduler that announced it: a member's round tickets are its
        self._keys: dict[str, bytes] = {}

    def __len__(self) -> int:
        return len(self._running)

    def announced(self, message: cpb.JobAnnouncement) -> None:
        job = message.job
        if message.state not in _RUNNING:
            self._bad.pop(job, None)
            self._keys.pop(job, None)
            if self._running.pop(job, None) is not None:
                log.info("job %s is no longer running: its pools are left", job)
            self._ended[job] = f"job {job} is {_state_name(message.state)}"
            while len(self._ended) > 256:
                del self._ended[next(iter(self._ended))]
            return
        self._ended.pop(job, None)
        if message.scheduler_key:
            self._keys[job] = message.scheduler_key
        known = self._running.get(job)
        if (known is not None and known[0] == message.spec) or self._bad.get(job) == message.spec:
            return  # announced again at every step: parsed (and said) once
        try:
            config = parse_job(
                message.spec, Path("/"), name=message.name or "job", check_data=False
            )
        except ConfigError as e:
            log.error("job %s has a bad spec: not taking its pools' parts: %s", job, e)
            self._running.pop(job, None)
            self._bad[job] = message.spec
            return
        self._bad.pop(job, None)
        self._running[job] = (message.spec, config.runtime, config.training.stages)
        if known is None:
            log.info(
                "job %s runs: taking parts of its %d stages' pools", job, config.training.stages
            )

    def route(self, job: str, stage: int) -> None:
        """Refuse a `Reduce` for anything but a stage of a running job."""
        known = self._running.get(job)
        if known is None:
            why = self._ended.get(job, f"job {job!r} is unknown here")
            running = sorted(self._running) or "none"
            raise NotFound(f"{why}; this aggregator takes parts of running jobs only: {running}")
        stages = known[2]
        if not 0 <= stage < stages:
            raise NotFound(f"job {job} has stages 0..{stages - 1}, not {stage}")

    def scheduler_key(self, job: str) -> bytes | None:
        """The key of the scheduler that announced `job`, whose round tickets its members'
        contributions carry (`swarm.net.round_tickets`); None: announced with none."""
        return self._keys.get(job)

    def timeout_of(self, job: str) -> float | None:
        """`job`'s averaging timeout, its rounds' (None: not running here)."""
        running = self._running.get(job)
        return None if running is None else running[1].averaging_timeout_s

    def served(self) -> tuple[int, int, float] | None:
        """`(chunk_bytes, max_bytes, timeout_s)` for every job's pool at once: the smallest
        chunk any job takes (clamped as a member clamps it), the largest timeout; None: none."""
        if not self._running:
            return None
        runtimes = [runtime for _, runtime, _ in self._running.values()]
        chunk = min(
            min(max(r.chunk_bytes, _PEERS.min_chunk_bytes), self._max_chunk) for r in runtimes
        )
        return (
            chunk,
            max(r.max_tensor_bytes for r in runtimes),
            max(r.averaging_timeout_s for r in runtimes),
        )


class AggregatorMetrics:
    """Its series: `swarm_peer_info` (what it does), its link rates, the jobs it follows, the
    bytes it holds of its budget and the averaging bytes it moved. `link`: its meter, which its
    PoolService's streams record their bytes in (`stage_server.peer.links`)."""

    def __init__(self, peer: str, budget: ReceiveBudget, jobs: PoolJobs) -> None:
        self.registry = reg = CollectorRegistry()
        self.peer, self.state = peer, "starting"  # then "aggregating", at last "offline"
        self.link = LinkMeter()
        reg.register(_PeerInfo(self))
        Gauge(
            "swarm_aggregator_jobs", "Running jobs whose pools it takes parts in", registry=reg
        ).set_function(lambda: len(jobs))
        held = Gauge(
            "swarm_aggregator_memory_bytes", "Bytes of received parts held now", registry=reg
        )
        held.set_function(lambda: budget.in_use)
        limit = Gauge("swarm_aggregator_memory_limit_bytes", "--max-memory-bytes", registry=reg)
        limit.set(budget.max_bytes)
        self._sent = Counter(
            "swarm_aggregator_bytes_sent_total", "Sums sent (as encoded)", registry=reg
        )
        self._received = Counter(
            "swarm_aggregator_bytes_received_total", "Parts received (as encoded)", registry=reg
        )

    def moved(self, sent: int, received: int) -> None:
        self._sent.inc(sent)
        self._received.inc(received)


class _PeerInfo(Collector):
    """`swarm_peer_info` as a stage server's (one series, what it does in its labels), its
    state "aggregating": it serves no job or stage of its own; and as a stage server's,
    `swarm_peer_link_bytes_per_second{peer,direction}`, the rates it announces (0: unknown)."""

    def __init__(self, metrics: AggregatorMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = {"peer": self.metrics.peer, "state": self.metrics.state, "job": "", "stage": ""}
        family = GaugeMetricFamily(
            "swarm_peer_info", "This aggregator (1): what it does now", labels=list(labels)
        )
        family.add_metric(list(labels.values()), 1)
        yield family
        rates = GaugeMetricFamily(
            "swarm_peer_link_bytes_per_second",
            "This peer's link rate, bytes/s, measured from its transfers or set by --bandwidth",
            labels=["peer", "direction"],
        )
        for direction in DIRECTIONS:
            rates.add_metric([self.metrics.peer, direction], self.metrics.link.rate(direction))
        yield rates


_STEP = re.compile(r"(\d+)/")  # a round's id starts with its step: "12/0", "12/local-1"


class _AggregatorPool(PoolServicer):
    """Its PoolService, with a stage server's averaging fault point (`SWARM_FAULTS`,
    `averaging@STEP`): SIGKILLed at the first contribution of that step's round it is sent,
    mid-round, as tests and benchmarks kill an owner."""

    async def Reduce(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pool_pb2.PoolReduceResponse]:
        async for reply in super().Reduce(_at_fault_point(request_iterator), context):
            yield reply


async def _at_fault_point(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    first = True
    async for request in requests:
        if first and (step := _STEP.match(request.round)) is not None:
            maybe_die(Point.AVERAGING, int(step[1]))
        first = False
        yield request


@dataclass
class RunningAggregator:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    pool: PoolServicer
    jobs: PoolJobs
    budget: ReceiveBudget
    metrics: AggregatorMetrics
    address: str
    metrics_port: int | None
    grace_s: float
    announce_host: str

    @property
    def metrics_address(self) -> str:
        if self.metrics_port is None:
            return ""
        return host_port(self.announce_host, self.metrics_port)

    async def stop(self) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.grace_s)
        self.pool.averager.close()


async def start_aggregator(opts: AggregatorOptions, peer: str) -> RunningAggregator:
    """A listening PoolService that owns parts of running jobs' rounds (`PoolJobs.announced`
    tells it which jobs run)."""
    jobs = PoolJobs(opts.max_message_bytes - MESSAGE_HEADROOM)
    budget = ReceiveBudget(opts.max_memory_bytes, flag="--max-memory-bytes")
    metrics = AggregatorMetrics(peer, budget, jobs)
    metrics.link.fix(opts.upload_bytes_per_second, opts.download_bytes_per_second)
    limits = ServerLimits(opts.max_message_bytes, opts.max_message_bytes, opts.max_concurrent_rpcs)
    server = grpc_server(limits, token=opts.token, registry=metrics.registry)
    announce = announced_host(opts.host, opts.announce_host, "an aggregator")
    metrics_port = None
    if opts.metrics_port is not None:
        token = opts.metrics_token or opts.token
        metrics_port = serve_metrics(metrics.registry, opts.host, opts.metrics_port, token=token)
    port = add_port(server, host_port(opts.host, opts.port), "an aggregator")
    defaults = RuntimeConfig()
    pool = _AggregatorPool(
        Averager(),
        route=jobs.route,
        chunk_bytes=min(defaults.chunk_bytes, opts.max_message_bytes - MESSAGE_HEADROOM),
        max_bytes=opts.max_memory_bytes,
        timeout_s=defaults.averaging_timeout_s,
        served=lambda: _within(jobs.served(), opts.max_memory_bytes),
        peer=peer,
        on_bytes=metrics.moved,
        link=metrics.link,  # what its streams moved: its link's rates
        budget=budget,
        limit_name="--max-memory-bytes",
        scheduler_key=jobs.scheduler_key,
        timeout_of=jobs.timeout_of,
    )
    pool_pb2_grpc.add_PoolServiceServicer_to_server(pool, server)
    add_info(server, peer)  # the dial-back finds it by its peer id
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await server.start()
    for name in ("", POOL_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    metrics.state = "aggregating"
    address = host_port(announce, port)
    return RunningAggregator(
        server,
        health_servicer,
        pool,
        jobs,
        budget,
        metrics,
        address,
        metrics_port,
        opts.shutdown_grace_s,
        announce,
    )


def _state_name(state: int) -> str:
    """ "cancelled" for JOB_STATE_CANCELLED; the number of a state this build does not know."""
    try:
        return cpb.JobState.Name(state).removeprefix("JOB_STATE_").lower()  # type: ignore[arg-type]
    except ValueError:
        return f"in state {state}"


def _within(served: tuple[int, int, float] | None, max_bytes: int) -> tuple[int, int, float] | None:
    """A part is never larger than the memory it would be held in."""
    return None if served is None else (served[0], min(served[1], max_bytes), served[2])


class AggregatorAgent:
    """The aggregator on the bus: its announcement, and the jobs it follows."""

    def __init__(
        self, running: RunningAggregator, bus: BusLike, *, peer: str, opts: AggregatorOptions
    ) -> None:
        self.running, self.bus, self.peer, self.opts = running, bus, peer, opts

    def announcement(self) -> cpb.PeerAnnouncement:
        """Serving: its PoolService's address, its role, its link rates."""
        msg = cpb.PeerAnnouncement(
            peer=self.peer,
            address=self.running.address,
            metrics_address=self.running.metrics_address,
            device="cpu",
            state=cpb.PEER_STATE_SERVING,
            role=cpb.PEER_ROLE_AGGREGATOR,
            time=time.time(),
        )
        fill_rates(msg, self.running.metrics)  # --bandwidth's, else measured (0: not yet)
        return msg

    async def announce(self) -> None:
        await self.bus.publish(self.bus.topics.peer(self.peer), self.announcement(), retain=True)

    async def run(self, stop: asyncio.Event) -> None:
        jobs = self.bus.subscribe(self.bus.topics.job("+"))
        await self.announce()
        tasks = [
            asyncio.create_task(self._follow(jobs)),
            # announced again when its measured rates move (`stage_server.peer.links`)
            asyncio.create_task(reannounce(self.running.metrics, self.announce)),
        ]
        stopped = asyncio.create_task(stop.wait())
        try:
            # Its tasks end before a stop only when they fail: the bus gave up for good (another
            # process took the aggregator's id, say), which ends it with that error.
            await asyncio.wait({stopped, *tasks}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stopped, *tasks):
                task.cancel()
            ended = await asyncio.gather(*tasks, return_exceptions=True)
        for error in ended:
            if isinstance(error, Exception):
                raise error
        self.running.metrics.state = "offline"
        offline = offline_will(self.peer, self.running.address)
        offline.time = time.time()  # a clean stop, not a dropped connection
        await self.bus.publish(self.bus.topics.peer(self.peer), offline, retain=True)
        log.info("%s: stopped (SIGTERM or SIGINT); announced offline", self.peer)

    async def _follow(self, messages: object) -> None:
        async for topic, message in messages:  # type: ignore[attr-defined]
            try:
                if self.bus.topics.parse(topic).kind is TopicKind.JOB and isinstance(
                    message, cpb.JobAnnouncement
                ):
                    self.running.jobs.announced(message)
            except Exception:  # one bad announcement must not stop it following the others
                log.exception("%s: could not handle %s", self.peer, topic)


def offline_will(peer: str, address: str) -> cpb.PeerAnnouncement:
    """What the broker says of it when its connection drops (no time: it was not stopped)."""
    return cpb.PeerAnnouncement(
        peer=peer, address=address, state=cpb.PEER_STATE_OFFLINE, role=cpb.PEER_ROLE_AGGREGATOR
    )


async def run_aggregator(
    opts: AggregatorOptions, broker: str, connect_timeout_s: float = 30.0
) -> None:
    """`swarm aggregator --broker URL`: serve parts of the pools of running jobs until stopped."""
    torch.set_num_threads(max(1, opts.threads))
    # A directory of its own: an aggregator beside a stage server keeps a distinct id.
    identity = persistent_peer_id(cache_dir() / "aggregator", opts.peer)
    peer = identity.id
    try:
        running = await start_aggregator(opts, peer)
        try:
            will = (Topics().peer(peer), offline_will(peer, running.address))
            async with Bus(
                broker,
                client_id=f"peer-{peer}",
                username=peer,
                token=opts.token,
                will=will,
                remedy=f"stop the other aggregator, or give this one an id of its own (--peer "
                f"{peer}-2)",
            ) as bus:
                await bus.wait_connected(connect_timeout_s)
                agent = AggregatorAgent(running, bus, peer=peer, opts=opts)
                stop = asyncio.Event()
                install_signal_handlers(stop)
                print_ready(
                    "aggregator",
                    peer=peer,
                    address=running.address,
                    metrics=running.metrics_port,
                    max_memory_bytes=opts.max_memory_bytes,
                )
                await agent.run(stop)
        finally:
            await running.stop()
    finally:
        identity.release()
