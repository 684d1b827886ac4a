"""A stage server under a scheduler: it announces itself on the bus, measures its samples/s on the
stages of each job offered, takes the stage the scheduler assigns, builds it and serves it.

Bus traffic in, bus traffic out; compute (measuring, building a stage) runs on the replica's worker
thread so the event loop keeps answering health checks and the bus keepalive meanwhile.

What the peer becomes is logged here at INFO, once per change (measured, assigned, moving, serving,
released, stopped), and shown at the default level (stage_server/cli.py); `swarm_peer_info` says
what it does now.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from collections import OrderedDict
from pathlib import Path

import torch
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

from stage_server.peer.certificate import check_own_certificate
from stage_server.peer.fits import device_memory
from stage_server.peer.host_id import host_id
from stage_server.peer.identity import (
    PeerIdentity,
    cache_dir,
    new_incarnation,
    persistent_peer_id,
)
from stage_server.peer.limits import PeerLimits
from stage_server.peer.links import fill_rates, reannounce
from stage_server.peer.metrics import StageMetrics
from stage_server.peer.moving import describe_layers, plan_move, return_memory, stage_slowdown
from stage_server.peer.reachability import PeerPath, local_address
from stage_server.peer.take_up import TakeUp
from stage_server.replica.runtime import StageRuntime
from stage_server.replica.speed import measure_job
from stage_server.server import (
    SERVICE_NAME,
    RunningStageServer,
    StageServerOptions,
    check_device,
    start_grpc,
)
from stage_server.servicer import StageServicer
from swarm.bus.bounds import MAX_TEXT_CHARS
from swarm.bus.connection import Bus, BusLike, refusal_said
from swarm.bus.topics import TopicKind, Topics, parse_broker_url
from swarm.clock import Clock, MonotonicClock
from swarm.device.facts import DeviceFacts, TorchFacts
from swarm.device.oom import OutOfDeviceMemory, is_out_of_memory, oom_message
from swarm.errors import ConfigError
from swarm.job.config import JobConfig, RuntimeConfig, parse_job
from swarm.job.states import TERMINAL_PROTO
from swarm.net import tls
from swarm.net.addresses import announced_host, host_port
from swarm.ops.lifecycle import install_signal_handlers, print_ready, unless_stopped
from swarm.ops.rated import RatedLog
from swarm.proto import control_pb2 as cpb
from swarm.rpc import lan
from swarm.rpc.cache_room import Use, Uses
from swarm.rpc.init_fetch import InitSource, is_local, scheduler_init

# PeerIdentity and persistent_peer_id live in stage_server.peer.identity; named here for importers.
__all__ = ["PeerAgent", "PeerIdentity", "persistent_peer_id", "run_peer"]

log = logging.getLogger(__name__)
ENDED_REMEMBERED = 256
# A job this peer failed to measure (too big for its memory, say) is refused: it is measured
# again only when its spec changes or after this long, not on each of its announcements.
REFUSED_RETRY_S = 600.0
# Assignments are ordered by a generation, the scheduler's clock in microseconds. One from
# further ahead of this peer's clock than any honest skew is refused: a forged generation of
# 2^64 - 1 would otherwise make every later real assignment look stale, until a restart.
MAX_CLOCK_SKEW_S = 300.0
"""How many finished jobs a peer remembers (to ignore their assignments quietly)."""
# A stalled job runs on (a stage of it waits for a replica): its peers keep serving it.
_ACTIVE = (cpb.JOB_STATE_PLACING, cpb.JOB_STATE_RUNNING, cpb.JOB_STATE_STALLED)
_ENDED_WHY = {
    cpb.JOB_STATE_SUCCEEDED: "it succeeded",
    cpb.JOB_STATE_FAILED: "it failed",
    cpb.JOB_STATE_CANCELLED: "it was cancelled",
    cpb.JOB_STATE_QUEUED: "it was queued again",
}
_ENDED = TERMINAL_PROTO


class PeerAgent:
    def __init__(
        self,
        running: RunningStageServer,
        bus: BusLike,
        *,
        peer: str,
        device: str,
        throttle: float = 1.0,
        metrics_address: str = "",
        clock: Clock | None = None,
        metrics: StageMetrics | None = None,
        limits: PeerLimits | None = None,
        facts: DeviceFacts | None = None,
        path: PeerPath | None = None,
        relay_address: str = "",
        incarnation: str = "",
        host: str | None = None,
        init: InitSource | None = None,
        uses: Uses | None = None,
    ) -> None:
        """`incarnation`: this process's start id, as its last-will announces it (empty: a new
        one); `metrics`: whose `swarm_peer_info` follows what this peer does (None: none);
        `limits`: the peer's (its stages' footprints); `facts`: its device's (free memory);
        `path`: how others reach it, its relay (None: not followed); `relay_address`: the relay
        it runs itself (`--relay`); `host`: the host id it announces (None: this machine's,
        `stage_server.peer.host_id`); `init`: where a job's starting checkpoint not on this
        machine comes from (the scheduler, `--scheduler`; None: nowhere, the job is refused);
        `uses`: the cached checkpoints `init` holds for each job, let go as the job is forgotten
        (None: a set of its own)."""
        self.running, self.bus, self.peer, self.path = running, bus, peer, path
        self.relay_address = relay_address
        self.incarnation = incarnation or new_incarnation()
        self.host_id = host_id() if host is None else host  # its failure domain, a machine
        self.limits, self.facts = limits or PeerLimits(), facts or TorchFacts()
        self.clock = clock or MonotonicClock()
        self.device, self.throttle, self.metrics_address = device, throttle, metrics_address
        self.job_id = ""  # the job this peer is measured for or serves
        self.stage: int | None = None
        self.state = cpb.PEER_STATE_JOINING
        self.speeds: dict[int, float] = {}
        self.metrics = metrics
        self._building: tuple[str, int] | None = None  # the (job, stage) being built, if any
        self._taking = TakeUp()  # the job taken up now: its checkpoint fetched, its stages measured
        self._jobs: dict[str, JobConfig] = {}
        # The latest jobs announced finished (assignments to them are moot); a bounded memory:
        # the scheduler clears an ended job's retained assignments, and one to a job this peer
        # no longer knows is ignored anyway.
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._active: dict[str, cpb.JobAnnouncement] = {}  # jobs to join once free
        # Jobs this peer could not measure: their spec's hash and when; bounded like `_ended`.
        self._refused: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._refusal: tuple[str, str] | None = None  # the last job refused, and why: said
        self._generation = -1
        self.load_period_s = 1.0  # how often a serving peer publishes its load
        if init is not None and uses is None:
            raise ValueError("an init source holds what it fetches in `uses`: give the agent it")
        self.init = init
        self.uses = uses or Uses()

    def announcement(self) -> cpb.PeerAnnouncement:
        msg = cpb.PeerAnnouncement(
            peer=self.peer,
            address=self.running.address,
            metrics_address=self.metrics_address,
            device=self.device,
            state=self.state,
            job=self.job_id,
            throttle=self.throttle,
            samples_per_second=self.speeds,
            memory_bytes=device_memory(self.device),  # the scheduler bounds jobs' stages by it
            relay=self.path.relay if self.path is not None else "",
            relay_address=self.relay_address,
            incarnation=self.incarnation,
            host_id=self.host_id,
            public_address=self.path.public_address if self.path is not None else "",
            time=time.time(),
        )
        fill_rates(msg, self.metrics)  # its link rates (issue 43), announced anew as they move
        if self.stage is not None:
            msg.stage = self.stage
        if self._refusal is not None and not self.job_id:  # the job's status names it
            msg.refused_job, msg.refused = self._refusal
        return msg

    def activity(self) -> tuple[str, str, int | None]:
        """What this peer does now, for operators: (state, job, stage). Finer than the announced
        state, whose JOINING covers idle (no job), measuring and waiting (measured, no stage
        yet): to the scheduler these are one, to an operator they are not."""
        if self.state == cpb.PEER_STATE_OFFLINE:
            return "offline", "", None
        if self._building is not None:  # the stage it will serve
            job, stage = self._building
            return ("moving" if self.state == cpb.PEER_STATE_DRAINING else "building"), job, stage
        if self.state == cpb.PEER_STATE_SERVING:
            return "serving", self.job_id, self.stage
        if not self.job_id:
            return "idle", "", None
        if self._taking.fetching:  # its starting checkpoint
            return "fetching", self.job_id, None
        return ("waiting" if self.speeds else "measuring"), self.job_id, None

    def _show(self) -> None:
        if self.metrics is not None:
            self.metrics.became(*self.activity())

    async def announce(self) -> None:
        self._show()
        await self.bus.publish(self.bus.topics.peer(self.peer), self.announcement(), retain=True)

    async def run(self, stop: asyncio.Event) -> None:
        topics = self.bus.topics
        async with asyncio.TaskGroup() as tg:
            tasks = []
            if self.path is not None:  # its reachability; a relay while it needs one
                tasks.append(tg.create_task(self.path.run(self.bus, self.announce)))
                await unless_stopped(self.path.first_relay(), stop)  # --behind-nat: relayed
            await self.announce()
            subscription = self.bus.subscribe(topics.job("+"))
            assignments = self.bus.subscribe(topics.assign("+", self.peer))
            tasks += [
                tg.create_task(self._consume(subscription)),
                tg.create_task(self._consume(assignments)),
                tg.create_task(self._report_load()),
                tg.create_task(reannounce(self.metrics, self.announce)),
            ]
            await stop.wait()
            for task in tasks:
                task.cancel()
            await self._taking.stop()
        state, job, stage = self.activity()
        doing = (
            state
            + (f" stage {stage}" if stage is not None else "")
            + (f" of job {job}" if job else "")
        )
        self.state, self.stage = cpb.PEER_STATE_OFFLINE, None
        await self.announce()
        log.info("%s: stopped (SIGTERM or SIGINT) while %s; announced offline", self.peer, doing)

    async def _report_load(self) -> None:
        """While serving, publish queue depth and seconds/sample for the trainers' wiring."""
        servicer = self.running.servicer
        # Unsent for long, the scheduler counts the peer gone (`load_silence_s`): said here too,
        # once a minute, where the peer's operator looks.
        unsent = RatedLog(log, every_s=60.0)
        while True:
            await asyncio.sleep(self.load_period_s)
            if self.state != cpb.PEER_STATE_SERVING or self.stage is None:
                continue
            # A broker hiccup, or the device's claims unreadable for a moment (what the cache
            # holds reads them), must not stop the reports for good: raised here, it ended the
            # agent's task group, the process and every stage it served.
            try:
                await self.bus.publish(self.bus.topics.load(self.peer), self._load(servicer))
            except Exception as e:
                unsent.warning("load", "%s: load report not made or sent: %s", self.peer, e)

    def _load(self, servicer: StageServicer) -> cpb.LoadReport:
        """The load report of the stage `servicer` serves now."""
        runtime = servicer.runtime
        mb = runtime.job.training.microbatch_size
        # A microbatch's work here is a Forward and a Backward (one ForwardBackward at the last
        # stage): per-sample seconds of that, comparable to the join-time measurement.
        calls = 1 if runtime.is_last else 2
        ema = servicer.ema_seconds * calls if servicer.ema_seconds else None
        return cpb.LoadReport(
            peer=self.peer,
            job=self.job_id,
            stage=self.stage,
            queue_depth=servicer.waiting,
            in_flight=min(1, servicer.waiting),
            ema_seconds_per_sample=ema / mb if ema else 0.0,
            time=time.time(),
            boundary=servicer.metrics.boundary.report(),  # what `swarm status` sums
            activation_capacity=servicer.limits.capacity(runtime),  # trainers' windows
        )

    async def _consume(self, messages: object) -> None:
        async for topic, message in messages:  # type: ignore[attr-defined]
            try:
                await self._handle(topic, message)
            except Exception:  # a bad job or assignment must not take the peer down
                log.exception("%s: could not handle %s", self.peer, topic)

    async def _handle(self, topic: str, message: Message) -> None:
        kind = self.bus.topics.parse(topic).kind
        if kind is TopicKind.JOB and isinstance(message, cpb.JobAnnouncement):
            await self._on_job(message)
        elif kind is TopicKind.ASSIGN and isinstance(message, cpb.Assignment):
            await self._on_assignment(message)

    async def _compute(self, fn, *args):  # type: ignore[no-untyped-def]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.running.executor, fn, *args)

    async def _job(self, announcement: cpb.JobAnnouncement) -> JobConfig | ConfigError:
        """The announced job's config, parsed once and off the loop (a spec within its 1 MiB
        bound can take seconds); or why this peer cannot read it (a key of a newer swarm)."""
        if announcement.job not in self._jobs:
            try:
                config = await asyncio.to_thread(
                    parse_job,
                    announcement.spec,
                    Path("/"),
                    name=announcement.name or "job",
                    check_data=False,
                )
            except ConfigError as e:
                return e
            if announcement.job in self._ended:
                return config  # ended during the parse: nothing to keep it for
            self._jobs[announcement.job] = config
        return self._jobs[announcement.job]

    def _free_for(self, job: cpb.JobAnnouncement) -> bool:
        """Whether this peer may take up `job` now: idle (or measured for no other), and the job
        still running (announcements are read while a spec is parsed)."""
        idle = self.job_id in ("", job.job) and not self.speeds and not self._taking.busy
        return idle and job.job in self._active and job.job not in self._ended

    def _forget(self, job_id: str) -> None:
        """`job_id`'s config, and the cached checkpoint held for it: this peer reads it no more
        (another process of this machine may then make room by removing it,
        `swarm.rpc.cache_room`). Let go on the worker, after whatever it runs now: a build or
        measurement of the job under way there goes on reading it, ended or not."""
        self._jobs.pop(job_id, None)
        held = self.uses.take_out(job_id)
        if held:
            self.running.executor.submit(_release, held)

    async def _checkpoint(self, job_id: str, config: JobConfig) -> JobConfig:
        """`config` with its starting checkpoint (`model.init_from`) on this machine: where it
        names, else fetched from the scheduler into the cache (`swarm.rpc.init_fetch`)."""
        if is_local(config):
            return config
        if self.init is None:
            raise ConfigError(
                f"model.init_from = {config.model.init_from} is not on this machine, and this "
                "stage server knows no scheduler to fetch it from: give it --scheduler HOST:PORT "
                "(a --join invite names it)"
            )
        self._jobs[job_id] = await self.init(job_id, config)
        return self._jobs[job_id]

    async def _on_job(self, job: cpb.JobAnnouncement) -> None:
        if job.state in _ENDED:
            self._ended[job.job] = None
            self._ended.move_to_end(job.job)
            while len(self._ended) > ENDED_REMEMBERED:
                self._ended.popitem(last=False)
            self._active.pop(job.job, None)
            self._refused.pop(job.job, None)
            if job.job != self.job_id:
                self._forget(job.job)  # its config (and checkpoint) is needed no more
        elif job.state in _ACTIVE:
            self._active[job.job] = job
            self.running.servicer.trust(job)  # the scheduler's key, if it serves the job
            self._ended.pop(job.job, None)  # the scheduler says it runs: an earlier end is void
        if job.state in _ACTIVE and self._free_for(job):
            if self._still_refused(job):
                return
            config = await self._job(job)
            if not self._free_for(job):
                return  # taken up by another announcement meanwhile, or the job ended
            if isinstance(config, ConfigError):  # refused as a failed measurement is: said
                await self._refuse(job, config, "reading its spec")
                return
            self.job_id = job.job  # taken up: no other job's announcement starts another
            self._taking.start(job.job, self._take_up(job, config), self._next_waiting)
        elif job.job == self.job_id and job.state not in _ACTIVE and job.state:
            held = f"stage {self.stage} of job" if self.stage is not None else "(no stage) by job"
            why = _ENDED_WHY.get(job.state, "it ended")
            stopped = await self._taking.stop()
            if stopped is not None:  # a measurement under way ends on the worker, unread
                what = "'s starting checkpoint" if stopped == "fetching" else " (dropped)"
                log.info("%s: stopped %s job %s%s: %s", self.peer, stopped, job.job, what, why)
            log.info("%s: released %s %s: %s; free for another", self.peer, held, job.job, why)
            self.running.servicer.release()
            self._forget(job.job)
            self.job_id, self.stage, self.speeds = "", None, {}
            self.state = cpb.PEER_STATE_JOINING
            await self.announce()
            await self._next_waiting()

    async def _next_waiting(self) -> None:
        """Free again: take up the first job announced meanwhile that this peer may take."""
        for waiting in list(self._active.values()):
            await self._on_job(waiting)
            if self.job_id:
                break

    async def _take_up(self, job: cpb.JobAnnouncement, config: JobConfig) -> bool:
        """`job`'s starting checkpoint brought here, its stages measured and announced (True);
        False where either failed (the job refused, said why, the peer free again)."""
        self._taking.fetching = not is_local(config)
        self._show()  # fetching, or measuring
        try:  # measuring and building the stage both load the checkpoint's weights
            config = await self._checkpoint(job.job, config)
        except Exception as e:  # not fetched: free for the other jobs, and said why
            await self._refuse(job, e, failed="fetching its starting checkpoint")
            return False
        finally:
            self._taking.fetching = False
        self._show()  # measuring
        try:
            self.speeds = await self._compute(
                measure_job, config, check_device(self.device), self.throttle, self.limits
            )
        except Exception as e:  # too big for this peer, say: free for the other jobs
            await self._refuse(job, e)
            return False
        self._refusal = None  # a job taken up: an old refusal is no news
        log.info(
            "%s: measured for job %s: samples/s per stage %s; waiting for a stage",
            self.peer,
            job.job,
            {k: round(v, 1) for k, v in self.speeds.items()},
        )
        await self.announce()
        return True

    async def settled(self) -> None:
        """Wait until no job is being taken up (its checkpoint fetched, its stages measured)."""
        await self._taking.settled()

    def _still_refused(self, job: cpb.JobAnnouncement) -> bool:
        """Whether `job` was refused, with this spec, less than REFUSED_RETRY_S ago."""
        refused = self._refused.get(job.job)
        if refused is None:
            return False
        spec, at = refused
        return spec == _spec_hash(job) and self.clock.now() - at < REFUSED_RETRY_S

    async def _refuse(
        self, job: cpb.JobAnnouncement, error: Exception, failed: str = "measuring its stages"
    ) -> None:
        """Give up `job`, which this peer could not measure (or build a stage of: `failed`
        says), and say so: announced free again (no job, no speeds, idle), the scheduler
        places it in another job."""
        log.warning(
            "%s: refused job %s: %s failed (%s: %s); free for another job, and not "
            "measuring it again for %.0f s unless its spec changes",
            self.peer,
            job.job,
            failed,
            type(error).__name__,
            error,
            REFUSED_RETRY_S,
        )
        # said in its announcements (`refused_job`, `refused`) until it takes up a job
        why = f"{failed} failed ({type(error).__name__}: {error})"
        short = why if len(why) <= MAX_TEXT_CHARS else why[: MAX_TEXT_CHARS - 3] + "..."
        self._refusal = (job.job, short)
        self._refused[job.job] = (_spec_hash(job), self.clock.now())
        self._refused.move_to_end(job.job)
        while len(self._refused) > ENDED_REMEMBERED:
            self._refused.popitem(last=False)
        self._forget(job.job)  # parsed anew next time: its spec may have changed
        self.job_id, self.stage, self.speeds = "", None, {}
        self.state = cpb.PEER_STATE_JOINING
        await self.announce()

    def _stale(self, assignment: cpb.Assignment) -> bool:
        """Whether `assignment` is one this peer took already (retained messages come again on
        a reconnect: silent) or older (of its job: the scheduler's clock gone back at a
        restart, said)."""
        if assignment.generation > self._generation:
            return False
        # older, of the job this peer is measured for or serves (another job's retained one is
        # an old assignment it moved on from, said again at each reconnect)
        if assignment.generation < self._generation and assignment.job == self.job_id:
            log.warning(
                "%s: ignored an assignment to stage %d of job %s stamped %.0f s before one "
                "this peer took: the scheduler's clock went back? Once it is right, restart "
                "this peer",
                self.peer,
                assignment.stage,
                assignment.job,
                (self._generation - assignment.generation) / 1e6,
            )
        return True

    async def _on_assignment(self, assignment: cpb.Assignment) -> None:
        if self._stale(assignment):
            return
        ahead_s = (assignment.generation - time.time_ns() // 1000) / 1e6
        if ahead_s > MAX_CLOCK_SKEW_S:
            log.warning(
                "%s: refused an assignment %.0f s ahead of this clock (more than %.0f s): "
                "forged, or the scheduler's clock is wrong",
                self.peer,
                ahead_s,
                MAX_CLOCK_SKEW_S,
            )
            return
        config = self._jobs.get(assignment.job)
        if assignment.job in self._ended:
            return
        if config is None:
            log.warning("%s: assigned to unknown job %s", self.peer, assignment.job)
            return
        self._generation = assignment.generation
        if (self.job_id, self.stage) == (assignment.job, assignment.stage):
            return
        layers, device = describe_layers(config, assignment.stage), check_device(self.device)
        self._building = (assignment.job, assignment.stage)
        try:
            if self.state == cpb.PEER_STATE_SERVING:  # a move: stop taking work for the old stage
                log.info(
                    "%s: moving from stage %s to stage %d of job %s (%s)",
                    self.peer,
                    self.stage,
                    assignment.stage,
                    assignment.job,
                    layers,
                )
                self.state = cpb.PEER_STATE_DRAINING
                await self.announce()
                await self._make_room(config, assignment.stage, device)
            else:
                log.info(
                    "%s: assigned stage %d of job %s (%s); building it",
                    self.peer,
                    assignment.stage,
                    assignment.job,
                    layers,
                )
                self._show()  # building
            runtime = await self._compute(StageRuntime, config, assignment.stage, device)
        except Exception as e:  # out of memory, say: idle again, with its reason, not DRAINING
            self._building = None
            self.running.servicer.release()  # a move's old stage: the scheduler moved it away
            await self._refuse(
                self._active.get(assignment.job) or cpb.JobAnnouncement(job=assignment.job),
                e
                if not is_out_of_memory(e)
                else OutOfDeviceMemory(
                    oom_message(config.name, assignment.stage, "building the stage", device, e)
                ),
                f"building stage {assignment.stage}",
            )
            return
        finally:
            self._building = None
        if assignment.job in self._ended:  # it ended while the stage was being built
            log.info("%s: job %s ended; not serving its stage", self.peer, assignment.job)
            self._show()
            return
        self.running.servicer.throttle = self.throttle * stage_slowdown(assignment.stage)
        self.running.servicer.serve(runtime, assignment.job, self._active.get(assignment.job))
        await self.running.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        self.job_id, self.stage = assignment.job, assignment.stage
        self.state = cpb.PEER_STATE_SERVING
        await self.announce()
        log.info("%s: serving stage %d of job %s", self.peer, self.stage, self.job_id)

    async def _make_room(self, new: JobConfig, stage: int, device: torch.device) -> None:
        """A move: release the old stage first when `stage` of `new` does not fit beside it
        (`stage_server.peer.moving`)."""
        old = self._jobs.get(self.job_id)
        if old is not None and self.stage is not None:
            args = ((old, self.stage), (new, stage), device, self.limits, self.facts)
            plan = await self._compute(plan_move, *args)
            if not plan.beside:
                log.info(
                    "%s: releasing stage %s before building stage %d: %s",
                    self.peer,
                    self.stage,
                    stage,
                    plan.why,
                )
                self.running.servicer.release()
                await self._compute(return_memory, device)


def _spec_hash(job: cpb.JobAnnouncement) -> str:
    return hashlib.sha256(job.spec.encode()).hexdigest()


async def run_peer(
    opts: StageServerOptions,
    broker: str,
    *,
    throttle: float = 1.0,
    token: str | None = None,
    connect_timeout_s: float = 30.0,
    behind_nat: bool = False,
    scheduler: str = "",
) -> None:
    """`swarm stage-server --broker URL`: join the swarm and serve what the scheduler assigns;
    `behind_nat`: attach to a relay at once, not only once the scheduler finds it unreachable;
    `scheduler`: its job API, where a starting checkpoint not on this machine is fetched."""
    torch.set_num_threads(max(1, opts.threads))
    check_device(opts.device)
    identity = persistent_peer_id(cache_dir(), opts.peer)
    peer = identity.id
    # Before anything starts: a certificate its callers would refuse stops it here, with the fix.
    announce = announced_host(opts.host, opts.announce_host, "a stage server")
    check_own_certificate(tls.current(), announce, peer, behind_nat)
    opts = dataclasses.replace(opts, peer=peer)  # the metrics' peer label too
    at = parse_broker_url(broker)
    _check_login(peer, at.username)
    running = await start_grpc(opts, RuntimeConfig().max_message_bytes, throttle)
    incarnation = new_incarnation()  # the same in its last-will: a reconnection is told apart
    uses = Uses()  # the cached checkpoints its jobs read, held while it knows each job
    try:
        async with _bus(broker, peer, token, running.address, incarnation) as bus:
            await bus.wait_connected(connect_timeout_s)
            path = _path(opts, running, peer, token, behind_nat, host_port(at.host, at.port))
            lan.SHORTCUTS.scope = path.neighbour  # only its neighbours' LAN addresses probed
            agent = PeerAgent(
                running,
                bus,
                peer=peer,
                device=opts.device,
                throttle=throttle,
                metrics_address=running.metrics_address,
                metrics=running.servicer.metrics,
                limits=opts.limits,
                path=path,
                relay_address=running.relay_address,
                incarnation=incarnation,
                init=scheduler_init(scheduler, token, uses) if scheduler else None,
                uses=uses,
            )
            stop = asyncio.Event()
            install_signal_handlers(stop)
            print_ready(
                "stage-server",
                peer=peer,
                address=running.address,
                metrics=running.metrics_port,
                **running.relay_field(),
                device=opts.device,
                throttle=throttle,
            )
            with refusal_said():
                await agent.run(stop)
    finally:
        await running.stop()
        uses.close()
        identity.release()


def _release(held: list[Use]) -> None:
    for use in held:
        use.release()


def _check_login(peer: str, login: str | None) -> None:
    """Warn where the broker URL logs in as another user: the broker's ACL gives a login its
    own topics only, so every one of this peer's would be refused."""
    if login and login != peer:
        log.warning(
            "%s: the broker URL logs in as %r: the broker's ACL will refuse this peer's "
            "topics unless the peer id (--peer) is that user",
            peer,
            login,
        )


def _bus(broker: str, peer: str, token: str | None, address: str, incarnation: str) -> Bus:
    """The peer's bus, its last-will saying it is offline (this incarnation: a reconnection is
    told apart); a second peer under the same id is refused with the remedy."""
    will = cpb.PeerAnnouncement(
        peer=peer, state=cpb.PEER_STATE_OFFLINE, address=address, incarnation=incarnation
    )
    return Bus(
        broker,
        client_id=f"peer-{peer}",
        username=peer,
        token=token,
        will=(Topics().peer(peer), will),
        remedy=f"stop the other stage server, or give this one an id of its own (--peer "
        f"{peer}-2; stage servers sharing a cache directory take one each by themselves)",
    )


def _path(
    opts: StageServerOptions,
    running: RunningStageServer,
    peer: str,
    token: str | None,
    behind_nat: bool,
    outside: str,
) -> PeerPath:
    """How the peer is reached: its address, its LAN one, through a relay (at once where it is
    `behind_nat`), and where its metrics are; `outside` (the broker) tells its own outage from
    its relay's."""
    local = local_address(opts.host, int(running.address.rsplit(":", 1)[1]))
    return PeerPath(
        peer,
        running.address,
        local=local,
        token=token,
        behind_nat=behind_nat,
        metrics=running.servicer.metrics,
        metrics_port=running.metrics_port,
        metrics_address=running.metrics_address,
        outside=outside,
    )
