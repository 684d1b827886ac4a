"""The stage-server process: build the stage, serve `StageService` and health, serve `/metrics`,
shut down in order on SIGTERM/SIGINT (a second signal forces exit)."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from stage_server.averaging.service import PoolServicer
from stage_server.averaging.spill import spill_directory
from stage_server.peer.limits import PeerLimits
from stage_server.peer.metrics import StageMetrics
from stage_server.replica.runtime import StageRuntime
from stage_server.servicer import StageServicer
from swarm.device.compiled import CompiledRuns, compiles
from swarm.device.facts import evictions_line, peak_memory
from swarm.errors import NotFound, SwarmError
from swarm.job.config import JobConfig, RuntimeConfig
from swarm.job.fingerprint import fingerprint
from swarm.net import tls
from swarm.net.addresses import announced_host, host_port
from swarm.net.ports import PortInUse
from swarm.net.tokens import add_port
from swarm.ops.lifecycle import install_signal_handlers, print_ready
from swarm.ops.metrics import serve_metrics
from swarm.ops.poison import Poison
from swarm.ops.rated import RatedLog
from swarm.proto import pool_pb2_grpc, stage_pb2_grpc
from swarm.relay.limits import raise_nofile
from swarm.relay.server import RelayLimits, RelayServer
from swarm.rpc.server_options import ServerLimits, grpc_server
from swarm.wire.chunking import grpc_options

__all__ = [
    "RunningStageServer",
    "StageServerOptions",
    "check_device",
    "grpc_options",
    "run_stage_server",
    "start_grpc",
    "start_stage_server",
]

log = logging.getLogger(__name__)
SERVICE_NAME = "swarm.proto.StageService"


@dataclass(frozen=True)
class StageServerOptions:
    stage: int
    host: str = "127.0.0.1"  # the interface to listen on (0.0.0.0 or :: for all)
    port: int = 0  # 0: any free port (printed in the ready line)
    announce_host: str = ""  # what others dial (its address and metrics); "": `host`
    metrics_port: int | None = None  # None: no /metrics; 0: any free port
    metrics_token: str | None = None  # /metrics requires it (None: `token`)
    device: str = "cpu"
    threads: int = 1  # torch intra-op threads; size to this process's share of cores
    compile_stage: bool = False  # CUDA: the stage's forward and backward compiled
    peer: str = ""  # defaults to host:port
    shutdown_grace_s: float = 10.0  # how long in-flight calls may finish after SIGTERM
    token: str | None = None  # swarm token every call must carry (None: open)
    limits: PeerLimits = field(default_factory=PeerLimits)  # what no job can raise
    # where a commit keeps the gradient sums it averages over in place (`stage_server.averaging.
    # spill`): "" the system's temp directory, "off" in memory
    spill_dir: str = ""
    bandwidth: tuple[float, float] = (0.0, 0.0)  # --bandwidth, bytes/s up, down (0: measured)
    # `--relay`: it also relays for peers behind NAT (`swarm.relay.server`), listening on `host` at
    # `relay_port` (0: any free port) and announced as `relay_address`
    relay: bool = False
    relay_port: int = 0
    relay_limits: RelayLimits = field(default_factory=RelayLimits)
    # the lies it tells in its stage compute (tests, benchmarks: `swarm.ops.poison`), armed at
    # its start; None: its process's SWARM_FAULTS'
    poison: Poison | None = None


@dataclass
class RunningStageServer:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    servicer: StageServicer
    executor: ThreadPoolExecutor
    address: str
    metrics_port: int | None
    grace_s: float
    announce_host: str = ""  # the host part of `address`
    relay: RelayServer | None = None  # `--relay`: the relay it runs beside its stage
    relay_port: int | None = None

    @property
    def relay_address(self) -> str:
        """Where peers behind NAT attach to its relay ("" when it runs none)."""
        if self.relay_port is None:
            return ""
        return host_port(self.announce_host or self.address.rsplit(":", 1)[0], self.relay_port)

    @property
    def metrics_address(self) -> str:
        """Where others scrape its /metrics ("" when it serves none)."""
        if self.metrics_port is None:
            return ""
        return host_port(self.announce_host or self.address.rsplit(":", 1)[0], self.metrics_port)

    def relay_field(self) -> dict[str, int]:
        """The ready line's `relay=PORT`, with `--relay` only."""
        return {} if self.relay_port is None else {"relay": self.relay_port}

    @property
    def runtime(self) -> StageRuntime:
        return self.servicer.runtime

    async def stop(self) -> None:
        await self.health.enter_graceful_shutdown()
        if self.relay is not None:  # first: the peers it carries re-attach elsewhere at once
            await self.relay.stop()
        await self.server.stop(self.grace_s)
        # Its handlers may outlive gRPC's stop: what reaches the worker now is refused cleanly.
        self.servicer.worker.close()
        self.servicer.stopped()  # its spill file goes now, not at its idle timer
        await self.servicer.channels.close()
        # What still runs there (a measurement, a stage being built) is waited for off the
        # loop, which goes on hearing signals meanwhile: a second one exits at once.
        await asyncio.to_thread(self.executor.shutdown, wait=True, cancel_futures=True)


def check_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: CUDA is not available on this machine")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise SystemExit(f"--device {device}: MPS is not available on this machine")
    return dev


def _served_pool(servicer: StageServicer) -> tuple[int, int, float] | None:
    """`(chunk_bytes, max_bytes, averaging_timeout_s)` of the job `servicer` serves now (`serve`
    installed its stage: from the command line, or an assignment under a scheduler), within the
    peer's limits; None while it serves none."""
    try:
        timeout_s = servicer.runtime.job.runtime.averaging_timeout_s
    except NotFound:
        return None
    return servicer.limits.chunk_bytes, servicer.limits.max_bytes, timeout_s


def _placed_by(servicer: StageServicer) -> bytes | None:
    """The key of the scheduler that placed the stage `servicer` serves (None: none did)."""
    return servicer.commit_auth.public if servicer.commit_auth is not None else None


async def start_grpc(
    opts: StageServerOptions, max_message_bytes: int, throttle: float = 1.0
) -> RunningStageServer:
    """A listening stage server that serves no stage yet (`servicer.serve` installs one)."""
    metrics = StageMetrics(opts.peer or "")
    metrics.link.fix(*opts.bandwidth)
    # gRPC holds a whole message before any check: at most the peer's ceiling, whatever the
    # job's max_message_bytes. Past max_concurrent_rpcs a call is refused (RESOURCE_EXHAUSTED)
    # before it is read: with the receive budget, no number of calls sizes this process's memory.
    message_bytes = min(max_message_bytes, opts.limits.max_message_bytes)
    limits = ServerLimits(message_bytes, message_bytes, opts.limits.max_concurrent_rpcs)
    server = grpc_server(limits, token=opts.token, registry=metrics.registry)
    announce = announced_host(opts.host, opts.announce_host, "a stage server")
    # /metrics first: a gRPC server that never started needs no stop when its port is taken.
    metrics_port = (
        serve_metrics(
            metrics.registry,
            opts.host,
            opts.metrics_port,
            token=opts.metrics_token or opts.token,
        )
        if opts.metrics_port is not None
        else None
    )
    port = add_port(server, host_port(opts.host, opts.port), "a stage server")
    address = host_port(announce, port)
    peer = opts.peer or address
    metrics.identify(peer)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage")
    servicer = StageServicer(
        peer=peer,
        metrics=metrics,
        executor=executor,
        throttle=throttle,
        token=opts.token,
        limits=opts.limits,
        spill_dir=spill_directory(opts.spill_dir),
        poison=opts.poison,
    )
    stage_pb2_grpc.add_StageServiceServicer_to_server(servicer, server)
    served = servicer.limits  # the defaults within the peer's until a stage is installed
    pool = PoolServicer(
        servicer.averager,
        route=servicer._route,
        chunk_bytes=served.chunk_bytes,
        max_bytes=served.max_bytes,
        timeout_s=RuntimeConfig().averaging_timeout_s,
        served=lambda: _served_pool(servicer),
        peer=peer,
        budget=servicer.budget,
        limit_name=served.max_bytes_name,
        link=metrics.link,  # an owner's streams: its link's rates too
        observe=metrics.observe,  # the calls it answers as an owner, in swarm_stage_requests_total
        scheduler_key=lambda job: _placed_by(servicer),
    )
    pool_pb2_grpc.add_PoolServiceServicer_to_server(pool, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    running = RunningStageServer(
        server,
        health_servicer,
        servicer,
        executor,
        address,
        metrics_port,
        opts.shutdown_grace_s,
        announce,
    )
    if opts.relay:
        try:
            running.relay_port = await _start_relay(running, opts)
        except BaseException:
            await running.stop()
            raise
    return running


async def _start_relay(running: RunningStageServer, opts: StageServerOptions) -> int:
    """Run a relay beside the stage (`--relay`); its port."""
    # Its series on this server's /metrics; strangers' refusals logged rated.
    registry, refusals = running.servicer.metrics.registry, RatedLog(log)
    raise_nofile()  # the relay's limits are sized to the descriptors this process may open
    identity = tls.current()  # with the swarm's CA, only a certificate naming a peer attaches as it
    relay = RelayServer(
        opts.token,
        opts.relay_limits,
        registry=registry,
        refusals=refusals,
        ca=identity.ca if identity is not None else None,
    )
    try:
        port = await relay.start(opts.host, opts.relay_port)
    except (OSError, PortInUse) as e:
        raise SwarmError(
            f"the relay cannot listen on {host_port(opts.host, opts.relay_port)} ({e}): give "
            "--relay-port another port, or 0 for any free one"
        ) from None
    running.relay = relay
    # What it is announced as (`relay_address`), which peers sign their attaches for.
    relay.addresses.add(host_port(running.announce_host or running.address.rsplit(":", 1)[0], port))
    log.info(
        "%s: relaying for peers behind NAT at %s",
        running.servicer.peer,
        host_port(running.announce_host, port),
    )
    return port


async def start_stage_server(
    job: JobConfig, opts: StageServerOptions, throttle: float = 1.0
) -> RunningStageServer:
    """A stage server for `opts.stage` of `job`, given on the command line (no scheduler)."""
    runtime = StageRuntime(job, opts.stage, check_device(opts.device))
    if compiles(opts.compile_stage, runtime.device):
        runtime.compiled = CompiledRuns()
    elif opts.compile_stage:
        log.info("--compile-stage: eager on %s (compiled runs are for CUDA)", runtime.device)
    running = await start_grpc(opts, job.runtime.max_message_bytes, throttle)
    running.servicer.serve(runtime, fingerprint(job))
    await running.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    return running


async def run_stage_server(job: JobConfig, opts: StageServerOptions, throttle: float = 1.0) -> None:
    """Serve until SIGTERM/SIGINT. Prints one ready line that tools and tests wait for."""
    torch.set_num_threads(max(1, opts.threads))
    running = await start_stage_server(job, opts, throttle)
    stop = asyncio.Event()
    install_signal_handlers(stop)
    rt = running.runtime
    print_ready(
        "stage-server",
        stage=opts.stage,
        address=running.address,
        metrics=running.metrics_port,
        **running.relay_field(),
        layers=f"{rt.layers[0]}..{rt.layers[-1]}",
        params=rt.num_parameters(),
        device=rt.device,
        host=socket.gethostname(),
    )
    await stop.wait()
    log.info(
        "stage %d: stopped (SIGTERM or SIGINT); calls in flight may finish within %.0f s",
        opts.stage,
        opts.shutdown_grace_s,
    )
    await running.stop()
    peak = peak_memory(rt.device)  # what it took of the GPU: read by bench/gpu_check.sh
    if peak:
        log.info("stage %d: %s", opts.stage, peak)
    log.info("stage %d: %s", opts.stage, evictions_line(rt.cache_evictions))
    sys.stdout.flush()
