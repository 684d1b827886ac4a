"""The `swarm` command. Each subcommand parses its flags and hands over to its role's module.
Flags default from `SWARM_<FLAG>` environment variables (e.g. `SWARM_DEVICE=cuda:0`)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import logging
import sys
from typing import Protocol, cast

from swarm.errors import SwarmError
from swarm.flags import HelpFormatter, env_default, env_name

__all__ = ["COMMANDS", "CommandModule", "build_parser", "main", "parse"]


class CommandModule(Protocol):
    """What a command's module provides (e.g. `client.cli`): its flags and its body."""

    def add_arguments(self, command: str, parser: argparse.ArgumentParser) -> None: ...

    def run(self, command: str, args: argparse.Namespace) -> int: ...


# Command -> (the module that implements it, its one-line help). Modules are named, not imported:
# `swarm/` has no import edge to any role, and `swarm --help` loads none of them.
COMMANDS: dict[str, tuple[str, str]] = {
    "local": ("swarm.commands", "train a job in this one process (the reference)"),
    "stage-server": (
        "stage_server.cli",
        "join a swarm (--broker) or serve one stage of a job (--job, --stage)",
    ),
    "aggregator": (
        "stage_server.aggregator.cli",
        "own averaging parts in the pools of a swarm's running jobs (--broker): no model, no GPU",
    ),
    "scheduler": ("scheduler.cli", "run the scheduler: job API, placement, trainers"),
    "relay": (
        "stage_server.relay",
        "carry calls to stage servers behind NAT over connections they open themselves",
    ),
    "submitter-token": (
        "scheduler.cli",
        "print the token that names a submitter (from the scheduler's --admin-token-file)",
    ),
    "broker": ("swarm.commands", "run the embedded MQTT broker (amqtt)"),
    "broker-config": (
        "swarm.bus.broker_config",
        "write Mosquitto's configuration, password file and ACL for a swarm's peers",
    ),
    "prepare-data": (
        "swarm.commands",
        'tokenize text files into a token file, the data of a [data] kind = "tokens" job',
    ),
    "certs": (
        "swarm.commands",
        "make the swarm's CA (certs init) and a host's certificate (certs issue NAME --host H; "
        "a peer behind NAT: --peer ID)",
    ),
    "invite": (
        "swarm.net.invite",
        "write one file that lets a friend's peer join (broker, scheduler, CA, a certificate "
        "for NAME, tokens): they pass it as --join FILE",
    ),
    "generate": ("swarm.commands", "sample text from a trained model (a Hugging Face checkpoint)"),
    "doctor": (
        "stage_server.doctor",
        "check this machine before it serves: the device, the torch build's kernels for it, "
        "memory for a job's largest stage (--job), the broker and scheduler answering",
    ),
    "submit": ("client.cli", "submit a job file to the scheduler; prints the job id"),
    "status": ("client.cli", "show a job's state, progress and replicas per stage"),
    "jobs": ("client.cli", "list the scheduler's jobs, newest first"),
    "cancel": ("client.cli", "cancel a queued or running job"),
    "delete": (
        "client.cli",
        "delete a finished job: its record, checkpoints and final model (cancel it first)",
    ),
    "export": ("client.cli", "download a job's whole model as a torch state_dict"),
    "simulate": (
        "scheduler.sim.cli",
        "simulate a swarm of heterogeneous, unreliable peers driven by the real wiring, "
        "placement and rebalancing policies; prints throughput against the optimum",
    ),
    "trainer": (
        "client.cli",
        "train a job: lease its microbatches from a scheduler (--scheduler, --job ID), "
        "or drive given stage servers yourself (--job FILE, --stage-servers)",
    ),
    "demo": ("client.cli", "train a small model on a local swarm of stage servers"),
    "health": (
        "swarm.rpc.health_probe",
        "ask a role's gRPC health service whether it serves (a container's health check)",
    ),
}


def load(command: str) -> CommandModule:
    return cast(CommandModule, importlib.import_module(COMMANDS[command][0]))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command with its help; only `command`'s flags (its module is imported for them).
    With no `command`, the subparsers take no flags and no `--help` of their own."""
    fmt = HelpFormatter  # each flag's default, shown once
    parser = argparse.ArgumentParser(prog="swarm", description=__doc__, formatter_class=fmt)
    parser.add_argument(
        "--log-level",
        default=env_default("log-level", "WARNING"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help=f"logging level [env {env_name('log-level')}]",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help) in COMMANDS.items():
        chosen = name == command
        p = sub.add_parser(name, help=help, description=help, formatter_class=fmt, add_help=chosen)
        if chosen:
            load(name).add_arguments(name, p)
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Two passes: the first finds the command (and answers `swarm --help` and mistakes before
    it), the second parses everything with that command's flags."""
    argv = sys.argv[1:] if argv is None else argv
    command = build_parser().parse_known_args(argv)[0].command
    return build_parser(command).parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        from swarm.net import invite, tls

        invite.apply_join(args)  # `--join FILE`: the invite's values in the flags, first
        tls.configure_from_args(args)  # the process's TLS identity, for every connection
        return int(load(args.command).run(args.command, args) or 0)
    except SwarmError as e:
        print(f"swarm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    """The `swarm` command's process (and `python -m swarm.cli`'s): `main`, then an exit that
    skips the interpreter's last collection. That collection walks every object the gc tracks,
    torch's modules' included: about 1 s of CPU per role process once its work is done, and a
    swarm's processes stopping together wait seconds on it. Frozen, they are simply left to the
    process's end: nothing of ours is finalised by it (a role forked by the tests, which ends
    with os._exit, never ran it). `main` itself does not freeze: tests call it in-process.
    Its event loops' default thread pool is named at the OS (`swarm.ops.threads`: a pool
    grown to its bound is then told from a leak), here and not in `main`, for the same
    reason."""
    from swarm.ops.threads import NamedPools

    asyncio.set_event_loop_policy(NamedPools())
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
