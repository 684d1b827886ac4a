"""`swarm scheduler`: its flags, and the scheduler process (`scheduler.main`) they configure."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from scheduler.data_root import check_data_root
from scheduler.dial_scope import private_swarm
from scheduler.store_file import hold
from swarm.bus.flags import add_login_flags, scheduler_token
from swarm.flags import (
    add_flag,
    add_insecure_no_token,
    add_metrics_token,
    add_secret,
    add_switch,
    add_token,
    env_name,
    metrics_token,
    secret,
    token,
    warn_if_url_password,
)
from swarm.net.ports import Listener, PortFlag, naming
from swarm.net.tls import add_tls_flags
from swarm.ops.logs import show_at_default

__all__ = ["add_arguments", "run"]

_PORT = PortFlag(Listener.GRPC, "--port", env_name("scheduler-port"))
_METRICS_PORT = PortFlag(Listener.METRICS, "--metrics-port", env_name("scheduler-metrics-port"))
_BROKER_PORT = PortFlag(Listener.BROKER, "--broker-port", env_name("broker-port"))


def add_arguments(command: str, p: argparse.ArgumentParser) -> None:
    """`swarm scheduler`'s flags, a group per concern (`swarm submitter-token`: its name and
    the admin's credential)."""
    if command == "submitter-token":
        p.add_argument(
            "name",
            help="the submitter the token names (letters, digits, . _ -); admin: the admin's "
            "own credential",
        )
        _add_admin_token(p)
        return
    _add_listeners(p)
    _add_storage(p)
    _add_training(p)
    _add_submitters(p)
    _add_peers(p)
    _add_credentials(p)


def _add_listeners(p: argparse.ArgumentParser) -> None:
    """Where it listens and is dialled: the embedded broker, the job API, /metrics."""
    add_flag(p, "broker", None, "MQTT broker URL (default: run an embedded broker)")
    add_flag(p, "broker-port", 0, "embedded broker's port (0: any free port)", type=int)
    add_flag(p, "host", "127.0.0.1", "address to listen on (0.0.0.0 or :: for every interface)")
    add_flag(
        p,
        "announce-host",
        "",
        "address other machines dial to reach the job API and the embedded broker (default: "
        "--host; required with --host 0.0.0.0)",
    )
    add_flag(
        p, "port", 7700, "job API gRPC port (0: any free port)", env="scheduler-port", type=int
    )
    add_flag(
        p,
        "metrics-port",
        None,
        "serve /metrics on this port (0: any free port)",
        env="scheduler-metrics-port",
        type=int,
    )
    add_metrics_token(p)


def _add_storage(p: argparse.ArgumentParser) -> None:
    """What it keeps and reads: the job store, the checkpoints, the data jobs may name, the
    finished jobs kept."""
    add_flag(p, "store", Path("swarm-jobs.sqlite"), "SQLite job store", type=Path)
    add_flag(
        p, "checkpoint-dir", Path("swarm-checkpoints"), "where trained models are kept", type=Path
    )
    add_flag(
        p,
        "data-root",
        None,
        "the only directory whose files (and its subdirectories') a submitted job may name as "
        "its data; required, and refused if it holds the store, the checkpoints or TLS files",
        type=Path,
    )
    add_flag(
        p,
        "keep-finished-jobs",
        None,
        "keep each submitter's this many most recently ended jobs; older ones are deleted with "
        "their checkpoints and final models, at start and as jobs end (default: keep every one)",
        type=int,
    )


def _add_training(p: argparse.ArgumentParser) -> None:
    """How it trains jobs: when a peer or a stage counts as lost, how often it checkpoints,
    the replicas every stage gets first, and whether it trains in its own process."""
    add_flag(
        p,
        "load-silence-s",
        10.0,
        "leave out serving peers whose load reports stop this long",
        type=float,
    )
    add_flag(
        p,
        "lost-stage-grace-s",
        30.0,
        "a trained job whose stage nobody serves waits this long for its replica, then gives "
        "the stage to fresh peers and rolls back to the last checkpoint; a job's start waits "
        "as long for a replica of each stage at the step the job has recorded",
        type=float,
    )
    add_flag(
        p,
        "checkpoint-every-s",
        300.0,
        "checkpoint every job at least this often (seconds; besides its checkpoint_every "
        "steps), so that losing a stage's only replica costs minutes of training, not the job "
        "(0: by steps only)",
        type=float,
    )
    add_flag(
        p,
        "min-replicas",
        1,
        "replicas every stage of a job gets before any stage gets more, and keeps when "
        "rebalancing feeds the bottleneck, for jobs whose runtime.min_replicas is unset (2: a "
        "spare per stage, so one lost replica costs no rollback)",
        type=int,
    )
    add_switch(
        p,
        "no-embedded-trainer",
        "train no job in the scheduler's own process: only `swarm trainer --job J` processes "
        "(run near the data, or where the scheduler's machine is small) train, and a job waits "
        "for one",
    )


def _add_submitters(p: argparse.ArgumentParser) -> None:
    """What submitters may do: their unfinished jobs, their pace, a stage's size; the admin's
    credential."""
    add_flag(
        p,
        "max-jobs-per-submitter",
        8,
        "unfinished jobs (queued or training) one submitter may have; SubmitJob refuses more "
        "(0: no cap)",
        type=int,
    )
    add_flag(
        p,
        "max-submits-per-minute",
        30.0,
        "jobs one submitter may submit a minute (a minute's worth at once, or "
        "--max-jobs-per-submitter if more); SubmitJob refuses faster ones, saying when to retry "
        "(0: no bound)",
        type=float,
    )
    add_flag(
        p,
        "max-stage-bytes",
        None,
        "refuse a job whose largest stage holds more state than this (bytes; weights, gradient "
        "sums and optimizer state); jobs are also refused past the largest memory a present peer "
        "announced",
        type=int,
    )
    _add_admin_token(p)


def _add_peers(p: argparse.ArgumentParser) -> None:
    """What it assumes of its peers: where its dial-back may reach them, and whether they hold
    the operator's own credentials (audits off by default)."""
    add_flag(
        p,
        "dial-scope",
        "auto",
        "where the dial-back may dial peers (and relays): 'public' addresses only, so that a "
        "peer cannot aim the scheduler's dials at its own network; 'any' address, private and "
        "loopback too (a swarm within one LAN or one machine); 'auto': 'any' when the "
        "scheduler itself announces a private or loopback address, else 'public'",
        choices=("auto", "public", "any"),
    )
    add_switch(p, "dial-private", "the same as --dial-scope any")
    add_switch(
        p,
        "trusted-peers",
        "every peer of this swarm holds the operator's own credentials (one admin, no invites "
        "to others): a job that does not set [trust] audit_fraction runs without audits, and "
        "`swarm status` says so ('audits off: the scheduler trusts its peers'); one that sets "
        "it is kept as it said. Off: audits on by default (a swarm open to other peers)",
    )


def _add_credentials(p: argparse.ArgumentParser) -> None:
    """Its own credentials: the swarm token, the MQTT login, TLS."""
    add_token(p)
    add_insecure_no_token(p)
    add_login_flags(p)
    add_tls_flags(p)


def _add_admin_token(p: argparse.ArgumentParser) -> None:
    add_secret(
        p,
        "admin-token",
        "the admin's token: it may cancel, delete and export every job, and submitter tokens "
        "(`swarm submitter-token NAME`) are made from it (default: SWARM_ADMIN_TOKEN; none: no "
        "admin token, no submitter tokens)",
    )


def run(command: str, args: argparse.Namespace) -> int:
    if command == "submitter-token":
        return _submitter_token(args)
    from swarm.net.tokens import refuse_open_host  # here: --help needs no gRPC

    warn_if_url_password(args, "broker")
    refuse_open_host("the scheduler", args.host, token=token(args), insecure=args.insecure_no_token)
    # Before the slow start below: a store another scheduler holds (for this process's life),
    # a port another process listens on (by its flag).
    ports = [(_PORT, args.port), (_METRICS_PORT, args.metrics_port)]
    if not args.broker:
        ports.append((_BROKER_PORT, args.broker_port))
    with hold(args.store), naming(args.host, ports):
        _run(args)
    return 0


def _run(args: argparse.Namespace) -> None:
    # Imported here: `swarm scheduler --help` needs only the flags, not torch and gRPC.
    from scheduler.main import SchedulerProcessOptions, run_scheduler

    # At the default level: each job's events (joins, leaves and why, stalls with their remedy,
    # rollbacks, its end), where its stages go, jobs resumed at start, finished jobs deleted.
    show_at_default(
        ("scheduler.history", "scheduler.assignments", "scheduler.service", "scheduler.retention")
    )
    check_data_root(args.data_root, {})  # given, and a directory; what it holds: at start
    opts = SchedulerProcessOptions(
        store=args.store,
        checkpoint_dir=args.checkpoint_dir,
        broker=args.broker,
        broker_port=args.broker_port,
        host=args.host,
        port=args.port,
        announce_host=args.announce_host,
        metrics_port=args.metrics_port,
        metrics_token=metrics_token(args),
        token=token(args),
        scheduler_token=scheduler_token(args),
        use_identity_as_username=args.use_identity_as_username,
        load_silence_s=args.load_silence_s,
        lost_stage_grace_s=args.lost_stage_grace_s,
        checkpoint_every_s=args.checkpoint_every_s or None,
        data_root=args.data_root,
        keep_finished_jobs=args.keep_finished_jobs,
        admin_token=secret(args, "admin-token"),
        max_jobs_per_submitter=args.max_jobs_per_submitter or None,
        max_submits_per_minute=args.max_submits_per_minute or None,
        max_stage_bytes=args.max_stage_bytes,
        embedded_trainer=not args.no_embedded_trainer,
        dial_private=_dial_private(args),
        min_replicas=args.min_replicas,
        trusted_peers=args.trusted_peers,
        secret_files=_secret_files(args),
    )
    asyncio.run(run_scheduler(opts))


# Its secrets that may come from a file (`swarm.flags.add_secret`): none of them may lie under
# the data root, whose files any token holder may fetch (a job's data, its starting checkpoint).
_SECRETS = ("token", "admin-token", "metrics-token", "scheduler-token")


def _secret_files(args: argparse.Namespace) -> dict[str, Path]:
    """The files the scheduler's secrets are read from, by flag."""
    named = {f"--{s}-file": getattr(args, f"{s.replace('-', '_')}_file", None) for s in _SECRETS}
    return {flag: Path(path) for flag, path in named.items() if path}


def _dial_private(args: argparse.Namespace) -> bool:
    """Whether the dial-back may dial private ranges (`--dial-scope`): under 'auto', when the
    scheduler announces a private address it heads a private swarm, its peers' private too."""
    if args.dial_private or args.dial_scope == "any":
        return True
    return args.dial_scope == "auto" and private_swarm(args.announce_host or args.host)


def _submitter_token(args: argparse.Namespace) -> int:
    """Print the submitter token of `args.name`, made from the admin token: give it to that
    submitter alone (`swarm submit --submitter-token-file`)."""
    from swarm.errors import ConfigError
    from swarm.net.submitters import ADMIN, admin_credential, submitter_token

    admin = secret(args, "admin-token")
    if not admin:
        raise ConfigError(
            "give the scheduler's admin token: --admin-token-file PATH or SWARM_ADMIN_TOKEN"
        )
    # `admin`: the admin's own credential, made as a submitter's is (the admin token stays here)
    print(admin_credential(admin) if args.name == ADMIN else submitter_token(admin, args.name))
    return 0
