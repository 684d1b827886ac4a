"""`swarm scheduler`: the job API over gRPC, the orchestration, `/metrics`, and an embedded broker
when no broker URL is given. Ordered shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from scheduler.admission import Admission
from scheduler.callers import Callers
from scheduler.data_root import check_data_root
from scheduler.dial_findings import was_reached
from scheduler.discovery import sd_document
from scheduler.job_api import JobApiServicer
from scheduler.service import Scheduler, SchedulerOptions, collector
from scheduler.store import JobStore
from swarm.bus.broker import EmbeddedBroker
from swarm.bus.connection import Bus
from swarm.bus.topics import SCHEDULER_USER
from swarm.net import tls
from swarm.net.addresses import announced_host, host_port
from swarm.net.tokens import add_port
from swarm.ops.lifecycle import install_signal_handlers, print_ready
from swarm.ops.metrics import serve_metrics
from swarm.ops.writable import writable_dir
from swarm.proto import scheduler_pb2_grpc
from swarm.rpc.server_options import SCHEDULER_LIMITS, grpc_server

__all__ = ["SchedulerProcessOptions", "run_scheduler"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerProcessOptions:
    store: Path  # SQLite job store; a restarted scheduler resumes from it
    checkpoint_dir: Path  # final models (and, later, checkpoints) per job
    data_root: Path | None  # SubmitJob reads job data only under it; required (None: refused)
    broker: str | None = None  # None: run an embedded broker on `broker_port`
    broker_port: int = 0  # embedded broker's port (0: any free port)
    host: str = "127.0.0.1"  # the interface to listen on (0.0.0.0 or :: for all)
    port: int = 0  # job API port (0: any free port)
    announce_host: str = ""  # what others dial (its job API, embedded broker); "": `host`
    metrics_port: int | None = None  # /metrics (0: any free port)
    metrics_token: str | None = None  # /metrics and /sd require it (None: `token`)
    token: str | None = None  # swarm token: required on every call and as MQTT password
    scheduler_token: str | None = None  # its own MQTT password (None: made up for an embedded
    # broker, else the swarm token); with `use_identity_as_username` the embedded broker takes
    # each client's MQTT user from its certificate's name
    use_identity_as_username: bool = False
    connect_timeout_s: float = 30.0  # how long to wait for the broker at start
    shutdown_grace_s: float = 5.0  # in-flight job API calls may finish within this
    load_silence_s: float = 10.0  # a serving peer silent this long on the load topic is out
    lost_stage_grace_s: float = 30.0  # an unserved stage of a trained job: wait, then roll back
    checkpoint_every_s: float | None = 300.0  # checkpoint at least this often (None: by steps)
    keep_finished_jobs: int | None = None  # finished jobs kept (None: all); older ones deleted
    admin_token: str | None = None  # may act on every job; submitter tokens derive from it
    max_jobs_per_submitter: int | None = 8  # unfinished jobs per submitter (None: no cap)
    max_submits_per_minute: float | None = 30.0  # per submitter (None: no bound)
    max_stage_bytes: int | None = None  # a job's largest stage's state at most (None: peers')
    embedded_trainer: bool = True  # train each job in this process too (False: remote only)
    dial_private: bool = False  # the dial-back may dial non-public addresses (--dial-private)
    min_replicas: int = 1  # for jobs without runtime.min_replicas: replicas every stage gets first
    # every peer holds the operator's own credentials: jobs' audits off unless they set them
    # (--trusted-peers, `scheduler.trusted_peers`)
    trusted_peers: bool = False
    # The files its secrets were read from, by flag (`--admin-token-file`: ...): kept out of the
    # data root, as the store and the TLS files are
    secret_files: dict[str, Path] = field(default_factory=dict)


async def run_scheduler(opts: SchedulerProcessOptions) -> None:
    """The scheduler process: its broker (embedded unless one is given), its bus, the
    orchestration and the job API, served until a signal; then an ordered shutdown."""
    identity = tls.current()
    data_root = _data_root(opts, identity)
    writable_dir(opts.checkpoint_dir, "--checkpoint-dir")  # before anything starts
    announce = announced_host(opts.host, opts.announce_host, "the scheduler")
    embedded: EmbeddedBroker | None = None
    broker = opts.broker
    if not broker:
        embedded = await _start_broker(opts, identity, announce)
        broker = embedded.local_url
    elif opts.token and not opts.scheduler_token:
        log.warning("scheduler: MQTT login with the swarm token; give it --scheduler-token")
    if opts.trusted_peers:  # said once, at start, and by every such job's status
        log.warning(
            "scheduler: --trusted-peers: jobs that do not set [trust] audit_fraction run "
            "without audits (every peer holds this operator's credentials)"
        )
    password = embedded.scheduler_token if embedded else opts.scheduler_token or opts.token
    store = JobStore(opts.store)
    registry = CollectorRegistry()
    try:
        # Its own broker is dialled on this machine (the announced address may not route back
        # here), and its certificate checked for the announced host, the name peers check.
        async with Bus(
            broker,
            "scheduler",
            token=password,
            username=SCHEDULER_USER,
            registry=registry,
            server_name=announce if embedded else None,
        ) as bus:
            await bus.wait_connected(opts.connect_timeout_s)
            scheduler = Scheduler(store, bus, _scheduler_options(opts, embedded), registry)
            registry.register(collector(scheduler))
            # Bounded below the handlers: messages, calls, streams, connections and their age.
            server = grpc_server(SCHEDULER_LIMITS, token=opts.token, registry=registry)
            scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(
                _job_api(opts, store, scheduler, data_root), server
            )
            health_servicer = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
            try:
                port = add_port(server, host_port(opts.host, opts.port), "the scheduler")
                await server.start()
                shown = embedded.url if embedded else broker
                await _serve(opts, scheduler, registry, health_servicer, port, announce, shown)
            finally:
                await health_servicer.enter_graceful_shutdown()
                await server.stop(opts.shutdown_grace_s)
    finally:
        store.close()
        if embedded:
            await embedded.stop()


def _data_root(opts: SchedulerProcessOptions, identity: tls.Tls | None) -> Path:
    """The data root jobs read from, checked before anything starts: what the scheduler keeps
    (its store, its checkpoints, its TLS files, the files of its secrets) stays out of it."""
    kept: dict[str, Path | None] = {"--store": opts.store, "--checkpoint-dir": opts.checkpoint_dir}
    kept |= opts.secret_files
    if identity is not None:
        kept["--tls-ca"], kept["--tls-cert"] = identity.ca_path, identity.cert_path
        kept["--tls-key"] = identity.key_path
    return check_data_root(opts.data_root, kept)


async def _start_broker(
    opts: SchedulerProcessOptions, identity: tls.Tls | None, announce: str
) -> EmbeddedBroker:
    """The embedded broker, started (no broker URL was given), at the announced host: peers
    dial it there and, with TLS, check its certificate for that name."""
    if identity is not None:  # peers dial its broker (and job API) there, and check it
        identity.check_names(announce, "the scheduler")
    embedded = EmbeddedBroker(
        host=opts.host,
        port=opts.broker_port,
        token=opts.token,
        announce_host=announce,
        scheduler_token=opts.scheduler_token,
        use_identity_as_username=opts.use_identity_as_username,
    )
    await embedded.start()
    return embedded


def _scheduler_options(
    opts: SchedulerProcessOptions, embedded: EmbeddedBroker | None
) -> SchedulerOptions:
    """The orchestration's settings from the process's. A ban binds the banned peer's
    certificate only where ids are bound to certificates (the embedded broker under
    --use-identity-as-username)."""
    return SchedulerOptions(
        opts.checkpoint_dir,
        token=opts.token,
        load_silence_s=opts.load_silence_s,
        lost_stage_grace_s=opts.lost_stage_grace_s,
        checkpoint_every_s=opts.checkpoint_every_s,
        keep_finished_jobs=opts.keep_finished_jobs,
        embedded_trainer=opts.embedded_trainer,
        min_replicas=opts.min_replicas,
        dial_private=opts.dial_private,
        bans_bind_credentials=embedded is not None and opts.use_identity_as_username,
    )


def _job_api(
    opts: SchedulerProcessOptions, store: JobStore, scheduler: Scheduler, data_root: Path
) -> JobApiServicer:
    """The job API: who may call it (`--admin-token`, submitter tokens), what a submitted job
    must fit (`Admission`), and where its data may come from (the data root)."""
    return JobApiServicer(
        store,
        scheduler,
        data_root=data_root,
        callers=Callers(opts.admin_token),
        admission=Admission(
            opts.max_jobs_per_submitter,
            opts.max_stage_bytes,
            scheduler.peer_registry.largest_memory,
            opts.max_submits_per_minute,
        ),
        trusted_peers=opts.trusted_peers,
    )


async def _serve(
    opts: SchedulerProcessOptions,
    scheduler: Scheduler,
    registry: CollectorRegistry,
    health_servicer: health.aio.HealthServicer,
    port: int,
    announce: str,
    broker: str,
) -> None:
    """With the job API listening: /metrics (and /sd), the ready line, the orchestration until
    SIGTERM/SIGINT."""
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    own: list[str] = [""]  # its metrics address, once bound

    def sd() -> tuple[str, bytes]:  # on the metrics thread: a copy of the registry's
        registry = scheduler.peer_registry
        peers = list(dict(registry.peers).values())
        return sd_document(own[0], peers, lambda peer: was_reached(registry, peer))

    metrics_port = (
        serve_metrics(
            registry,
            opts.host,
            opts.metrics_port,
            routes={"/sd": sd},
            token=opts.metrics_token or opts.token,
        )
        if opts.metrics_port is not None
        else None
    )
    if metrics_port is not None:
        own[0] = host_port(announce, metrics_port)
    stop = asyncio.Event()
    install_signal_handlers(stop)
    print_ready(
        "scheduler",
        address=host_port(announce, port),
        broker=broker,
        metrics=metrics_port,
        store=opts.store,
    )
    await scheduler.run(stop)
