"""`swarm stage-server`: its flags, and the choice between joining a swarm (`--broker`: the
scheduler assigns the stage) and serving one given stage of a job alone (`--job`, `--stage`)."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import fields
from pathlib import Path

from stage_server.peer.flags import add_peer_flags
from stage_server.peer.lan_host import serving_host
from stage_server.peer.limits import PeerLimits, flag_name
from swarm.errors import SwarmError
from swarm.flags import (
    add_flag,
    add_metrics_token,
    add_switch,
    at_least,
    env_name,
    metrics_token,
    token,
    warn_if_url_password,
)
from swarm.net.bandwidth import bandwidth_flag
from swarm.net.ports import Listener, PortFlag, naming
from swarm.ops import faults
from swarm.ops.logs import show_at_default
from swarm.relay.server import RelayLimits
from swarm.rpc import lan

__all__ = ["LIFECYCLE_LOGGERS", "add_arguments", "peer_limits", "run", "show_lifecycle"]

LIFECYCLE_LOGGERS = (
    "stage_server.agent",
    "stage_server.replica.speed",
    "stage_server.server",
    "stage_server.peer.reachability",
    "swarm.rpc.lan",
    "stage_server.peer.lan_host",
)
"""Whose INFO lines say what the server becomes, once each (measured, or its machine's figures
read, assigned stage K of job J, serving, moving, released and why, stopped; reachable directly
or through which relay; a relayed neighbour called at its LAN address): shown at the default
level too."""

_PORT = PortFlag(Listener.GRPC, "--port", env_name("stage-server-port"))
_METRICS_PORT = PortFlag(Listener.METRICS, "--metrics-port", env_name("stage-server-metrics-port"))


def add_arguments(command: str, p: argparse.ArgumentParser) -> None:
    add_flag(
        p,
        "broker",
        None,
        "MQTT broker URL, mqtt://[user:pass@]host:port or mqtts://...; a password there is this "
        "peer's own, sent instead of --token",
    )
    add_flag(
        p,
        "scheduler",
        "",
        "the scheduler's job API, HOST:PORT: a job's starting checkpoint (model.init_from) that "
        "is not on this machine is fetched from it (a --join invite names it)",
    )
    p.add_argument("--job", type=Path, required=False, help="job file (TOML)")
    p.add_argument("--stage", type=int, help="stage index, 0..stages-1 (with --job)")
    add_flag(
        p,
        "throttle",
        1.0,
        "make compute this many times slower (stands in for a slow device)",
        type=float,
    )
    add_peer_flags(p)
    add_flag(
        p,
        "announce-host",
        "",
        "address other machines dial to reach this server (default: --host; required with "
        "--host 0.0.0.0, e.g. behind NAT or in a container)",
    )
    add_flag(p, "port", 0, "gRPC port (0: any free port)", env="stage-server-port", type=int)
    add_flag(
        p,
        "metrics-port",
        None,
        "serve /metrics on this port (0: any free port)",
        env="stage-server-metrics-port",
        type=int,
    )
    add_metrics_token(p)
    add_flag(p, "device", "cpu", "torch device: cpu, cuda:N, mps")
    add_flag(p, "threads", 1, "torch threads: this process's share of the cores", type=at_least(1))
    add_switch(
        p,
        "compile-stage",
        "on CUDA, compile the stage's forward and backward for its microbatch shapes "
        "(torch.compile; eager on a CPU, always); a standalone server (--job --stage) only",
    )
    add_flag(
        p,
        "spill-dir",
        "",
        "where a pool's commit keeps this replica's gradient sums while it averages over them in "
        "place, on a disk (default: the system's temp directory; 'off': in memory, a copy of "
        "the gradient more at each commit)",
    )
    add_flag(
        p,
        "bandwidth",
        "",
        "this peer's link rates UP/DOWN in bits/s as tc writes them (100mbit/20mbit, 10M/100M; "
        "one value: both; 0: measured), announced instead of those measured from its transfers",
        type=bandwidth_flag,
    )
    _add_limits(p)
    _add_relay(p)


def _add_relay(p: argparse.ArgumentParser) -> None:
    """Peers behind NAT: this one relaying for them, or this one behind NAT."""
    add_switch(
        p,
        "relay",
        "also relay for peers behind NAT (reachable hosts only): calls to them travel over "
        "connections they opened to this server; announced with its address",
    )
    add_switch(
        p,
        "relay-only",
        "call peers behind NAT through their relay only, never at their LAN address first "
        "(by default one that answers there as itself, a peer behind this one's router, is "
        "called directly)",
    )
    add_flag(
        p,
        "relay-port",
        0,
        "the relay's port, with --relay (0: any free port, printed in the ready line)",
        env="stage-server-relay-port",
        type=int,
    )
    limits = RelayLimits()
    add_flag(p, "relay-max-peers", limits.max_peers, "peers behind NAT it carries", type=int)
    add_flag(p, "relay-max-calls", limits.max_tunnels, "calls it carries at once, in all", type=int)
    add_flag(
        p,
        "relay-max-calls-per-peer",
        limits.max_tunnels_per_peer,
        "calls it carries at once to one peer",
        type=int,
    )
    add_switch(
        p,
        "behind-nat",
        "attach to a relay at start (with --broker), not only once the scheduler's dial-back "
        "finds this server unreachable (implied by a --join invite made without --host)",
    )


def _add_limits(p: argparse.ArgumentParser) -> None:
    """This peer's own limits (`PeerLimits`): a job's `[runtime]` is clamped by them."""
    for f in fields(PeerLimits):
        flag = flag_name(f.name).removeprefix("--")
        add_flag(p, flag, f.default, f.metadata["help"], type=type(f.default))


def relay_limits(args: argparse.Namespace) -> RelayLimits:
    """The `RelayLimits` the flags say (`--relay-max-*`); the rest are the relay's own."""
    return RelayLimits(
        max_peers=args.relay_max_peers,
        max_tunnels=args.relay_max_calls,
        max_tunnels_per_peer=args.relay_max_calls_per_peer,
    )


def peer_limits(args: argparse.Namespace) -> PeerLimits:
    """The `PeerLimits` the flags say."""
    return PeerLimits(**{f.name: getattr(args, f.name) for f in fields(PeerLimits)})


def show_lifecycle() -> None:
    """At the default level an operator still sees what this server becomes: the INFO lines
    of `LIFECYCLE_LOGGERS`. Per-step lines are DEBUG."""
    show_at_default(LIFECYCLE_LOGGERS)


def run(command: str, args: argparse.Namespace) -> int:
    from swarm.net.tokens import refuse_open_host  # here: --help needs no gRPC

    warn_if_url_password(args, "broker")
    faults.arm()  # a malformed SWARM_FAULTS stops the server now, not at its first fault point
    show_lifecycle()
    # Behind NAT with no --host: its LAN address, for its neighbours' shortcut (before the
    # checks below, which judge the host it will listen on).
    args.host = serving_host(
        args.host,
        args.announce_host,
        behind_nat=args.behind_nat and not args.job,
        broker=args.broker or "",
        token=token(args),
    )
    refuse_open_host(
        "the stage server", args.host, token=token(args), insecure=args.insecure_no_token
    )
    # A port another process holds is refused before the slow start below, by its flag.
    with naming(args.host, [(_PORT, args.port), (_METRICS_PORT, args.metrics_port)]):
        _run(args)
    return 0


def _run(args: argparse.Namespace) -> None:
    # Imported here: `swarm stage-server --help` needs only the flags, not torch and gRPC.
    from stage_server.agent import run_peer
    from stage_server.doctor import preflight
    from stage_server.server import StageServerOptions, run_stage_server
    from swarm.device.kernels import deterministic_cublas
    from swarm.job.config import load_job

    show_lifecycle()
    # Before CUDA is touched: cuBLAS repeatable, for the audits of the jobs to come.
    deterministic_cublas(args.device)
    # `swarm doctor`'s device checks, before anything is built: a device this machine lacks, or
    # a torch without kernels for it, is named with its fix; and it becomes the current device.
    preflight(args.device)
    opts = StageServerOptions(
        stage=args.stage if args.stage is not None else -1,
        host=args.host,
        port=args.port,
        announce_host=args.announce_host,
        metrics_port=args.metrics_port,
        metrics_token=metrics_token(args),
        device=args.device,
        threads=args.threads,
        compile_stage=args.compile_stage,
        peer=args.peer,
        token=token(args),
        limits=peer_limits(args),
        spill_dir=args.spill_dir,
        bandwidth=args.bandwidth or (0.0, 0.0),
        relay=args.relay,
        relay_port=args.relay_port,
        relay_limits=relay_limits(args),
    )
    lan.SHORTCUTS.enabled = not args.relay_only
    if args.job:
        if args.stage is None:
            raise SwarmError("--job needs --stage (or leave out both to join a scheduler's swarm)")
        job = load_job(args.job)
        if not 0 <= args.stage < job.training.stages:  # before anything indexes the stages
            raise SwarmError(
                f"--stage {args.stage}: the job has stages 0..{job.training.stages - 1}"
            )
        asyncio.run(run_stage_server(job, opts, throttle=args.throttle))
    elif args.broker:
        joining = run_peer(
            opts,
            args.broker,
            throttle=args.throttle,
            token=opts.token,
            behind_nat=args.behind_nat,
            scheduler=args.scheduler,
        )
        asyncio.run(joining)
    else:
        raise SwarmError(
            "give --broker URL (or SWARM_BROKER) to join a swarm, "
            "or --job FILE --stage K to serve one stage on its own"
        )
