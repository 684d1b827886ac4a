"""The `swarm` command. Each subcommand parses its flags and hands over to its role's module.
Flags default from `SWARM_<FLAG>` environment variables (e.g. `SWARM_DEVICE=cuda:0`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from client.commands import add_client_commands
from scheduler.sim.cli import add_simulate_command
from swarm.errors import SwarmError

__all__ = ["build_parser", "main"]

log = logging.getLogger("swarm")


def _env_name(flag: str) -> str:
    return "SWARM_" + flag.upper().replace("-", "_")


def _env(flag: str, default: Any) -> Any:
    """The default of `--flag`: `SWARM_FLAG` if set (converted to the default's type)."""
    raw = os.environ.get(_env_name(flag))
    if raw is None:
        return default
    return type(default)(raw) if default is not None else raw


def _add(p: argparse.ArgumentParser, flag: str, default: Any, help: str, **kw: Any) -> None:
    help = f"{help} [env {_env_name(flag)}]"
    p.add_argument(f"--{flag}", default=_env(flag, default), help=help, **kw)


def _secret(p: argparse.ArgumentParser) -> None:
    # No default shown: help output must not print the secret from SWARM_TOKEN.
    p.add_argument(
        "--token",
        default=None,
        help="swarm token (default: SWARM_TOKEN; prefer it, flags show in `ps`)",
    )


def _job(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--job", type=Path, required=required, help="job file (TOML)")


def cmd_local(args: argparse.Namespace) -> int:
    import torch

    from swarm.config import load_job
    from swarm.progress import StepLog
    from swarm.reference import train_local

    job = load_job(args.job_file)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    with StepLog(job.training.steps, path=args.log, desc=f"local {job.name}") as steps:
        model = train_local(job, args.device, on_step=steps)
    if args.out:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.out)
        print(f"wrote {args.out}")
    return 0


def _token(args: argparse.Namespace) -> str | None:
    return args.token or os.environ.get("SWARM_TOKEN") or None


def cmd_stage_server(args: argparse.Namespace) -> int:
    from stage_server.agent import run_peer
    from stage_server.server import StageServerOptions, run_stage_server
    from swarm.config import load_job

    opts = StageServerOptions(
        stage=args.stage if args.stage is not None else -1,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        device=args.device,
        threads=args.threads,
        peer=args.peer,
        token=_token(args),
    )
    if args.job:
        if args.stage is None:
            raise SwarmError("--job needs --stage (or leave out both to join a scheduler's swarm)")
        asyncio.run(run_stage_server(load_job(args.job), opts, throttle=args.throttle))
    elif args.broker:
        asyncio.run(run_peer(opts, args.broker, throttle=args.throttle, token=opts.token))
    else:
        raise SwarmError(
            "give --broker URL (or SWARM_BROKER) to join a swarm, "
            "or --job FILE --stage K to serve one stage on its own"
        )
    return 0


def cmd_scheduler(args: argparse.Namespace) -> int:
    from scheduler.main import SchedulerProcessOptions, run_scheduler

    opts = SchedulerProcessOptions(
        store=args.store,
        checkpoint_dir=args.checkpoint_dir,
        broker=args.broker,
        broker_port=args.broker_port,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        token=_token(args),
        load_silence_s=args.load_silence_s,
        lost_stage_grace_s=args.lost_stage_grace_s,
    )
    asyncio.run(run_scheduler(opts))
    return 0


def cmd_broker(args: argparse.Namespace) -> int:
    from swarm.broker import run_broker

    async def serve() -> None:
        from swarm.lifecycle import install_signal_handlers

        stop = asyncio.Event()
        install_signal_handlers(stop)
        await run_broker(args.host, args.port, _token(args), stop)

    asyncio.run(serve())
    return 0


def cmd_trainer(args: argparse.Namespace) -> int:
    if args.scheduler and not args.stage_servers:
        from client.remote import run_remote_trainer

        return asyncio.run(
            run_remote_trainer(
                args.scheduler,
                args.job,
                token=_token(args),
                threads=args.threads,
                metrics_port=args.metrics_port,
            )
        )
    from client.standalone import parse_stage_servers, run_trainer
    from swarm.config import load_job

    if not args.stage_servers:
        raise SwarmError("give --scheduler ADDR --job JOB_ID, or --job FILE --stage-servers ...")
    job = load_job(args.job)
    return asyncio.run(
        run_trainer(
            job,
            parse_stage_servers(args.stage_servers),
            out=args.out,
            log_path=args.log,
            threads=args.threads,
            metrics_port=args.metrics_port,
            token=_token(args),
            checkpoint_dir=args.checkpoint_dir,
        )
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from client.demo import run_demo

    return run_demo(args.job, chaos=args.chaos)


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="swarm", description=__doc__, formatter_class=fmt)
    parser.add_argument(
        "--log-level",
        default=_env("log-level", "WARNING"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, func: Callable[[argparse.Namespace], int], help: str) -> Any:
        p = sub.add_parser(name, help=help, description=help, formatter_class=fmt)
        p.set_defaults(func=func)
        return p

    p = command("local", cmd_local, "train a job in this one process (the reference)")
    p.add_argument("job_file", type=Path, help="job file (TOML)")
    p.add_argument("--out", type=Path, help="write the trained model's state_dict here")
    _add(p, "device", "cpu", "torch device: cpu, cuda:N, mps")
    _add(p, "threads", 0, "torch threads (0: one per core)", type=int)
    p.add_argument("--log", type=Path, help="write one JSON line per step here")

    p = command(
        "stage-server",
        cmd_stage_server,
        "join a swarm (--broker) or serve one stage of a job (--job, --stage)",
    )
    _add(p, "broker", None, "MQTT broker URL, mqtt://[user:pass@]host:port or mqtts://...")
    _job(p, required=False)
    p.add_argument("--stage", type=int, help="stage index, 0..stages-1 (with --job)")
    _add(
        p,
        "throttle",
        1.0,
        "make compute this many times slower (stands in for a slow device)",
        type=float,
    )
    _add(p, "peer", "", "peer id (default: hostname-port)")
    _secret(p)
    _add(p, "host", "127.0.0.1", "address to listen on")
    _add(p, "port", 0, "gRPC port (0: any free port)", type=int)
    _add(p, "metrics-port", None, "serve /metrics on this port (0: any free port)", type=int)
    _add(p, "device", "cpu", "torch device: cpu, cuda:N, mps")
    _add(p, "threads", 1, "torch threads: this process's share of the cores", type=int)

    p = command("scheduler", cmd_scheduler, "run the scheduler: job API, placement, trainers")
    _add(p, "broker", None, "MQTT broker URL (default: run an embedded broker)")
    _add(p, "broker-port", 0, "embedded broker's port (0: any free port)", type=int)
    _add(p, "host", "127.0.0.1", "address to listen on")
    _add(p, "port", 7700, "job API gRPC port (0: any free port)", type=int)
    _add(p, "metrics-port", None, "serve /metrics on this port (0: any free port)", type=int)
    _add(p, "store", Path("swarm-jobs.sqlite"), "SQLite job store", type=Path)
    _add(p, "checkpoint-dir", Path("swarm-checkpoints"), "where trained models are kept", type=Path)
    _add(
        p,
        "load-silence-s",
        10.0,
        "leave out serving peers whose load reports stop this long",
        type=float,
    )
    _add(
        p,
        "lost-stage-grace-s",
        30.0,
        "a trained job whose stage nobody serves waits this long for its replica, then gives "
        "the stage to fresh peers and rolls back to the last checkpoint",
        type=float,
    )
    _secret(p)

    p = command("broker", cmd_broker, "run the embedded MQTT broker (amqtt)")
    _add(p, "host", "127.0.0.1", "address to listen on")
    _add(p, "port", 1883, "port", type=int)
    _secret(p)

    add_client_commands(command, _env)
    add_simulate_command(command, _env)

    p = command(
        "trainer",
        cmd_trainer,
        "train a job: lease its microbatches from a scheduler (--scheduler, --job ID), "
        "or drive given stage servers yourself (--job FILE, --stage-servers)",
    )
    p.add_argument("--job", required=True, help="job id (with --scheduler) or job file (TOML)")
    _add(p, "scheduler", None, "the scheduler's job API, HOST:PORT (ignored with --stage-servers)")
    _add(
        p,
        "stage-servers",
        None,
        "HOST:PORT of each stage in stage order, comma-separated; a stage's replicas "
        "separated by | (a,b|c,d: two replicas of stage 1); the trainer then drives them itself",
    )
    _secret(p)
    p.add_argument("--out", type=Path, help="write the trained model's state_dict here")
    p.add_argument("--log", type=Path, help="write one JSON line per step here")
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="with --stage-servers: write checkpoints here every "
        "training.checkpoint_every steps, and roll back to them",
    )
    _add(p, "threads", 1, "torch threads", type=int)
    _add(p, "metrics-port", None, "serve /metrics on this port (0: any free port)", type=int)

    p = command("demo", cmd_demo, "train a small model on a local swarm of stage servers")
    p.add_argument(
        "--job",
        type=Path,
        default=Path(__file__).resolve().parent.parent / "examples" / "tiny.toml",
        help="job file (TOML)",
    )
    p.add_argument(
        "--chaos",
        action="store_true",
        help="keep killing random replicas (SIGKILL) and starting fresh peers",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except SwarmError as e:
        print(f"swarm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
