"""Command-line flags that default from the environment: `--device` from `SWARM_DEVICE`, and so on.
Every role's `cli.py` declares its flags with these, so the rule is the same for all commands;
`HelpFormatter` shows each one's default once. Imported first by every command, it also sets the
process's environment default for gRPC's own logging (below)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

__all__ = [
    "HelpFormatter",
    "add_flag",
    "add_metrics_token",
    "add_switch",
    "add_token",
    "env_default",
    "env_name",
    "metrics_token",
    "token",
]

# gRPC's core logs every failed TLS handshake (a client without TLS, say) as raw lines on stderr
# at its INFO level, which it reads from GRPC_VERBOSITY once, when grpc is first imported. Every
# `swarm` command imports this module before grpc, so the default is set here: the side whose
# call failed says why in its own words (`swarm.net.tls_mismatch`). GRPC_VERBOSITY=INFO brings
# the core's lines back.
if not os.environ.get("GRPC_VERBOSITY"):
    os.environ["GRPC_VERBOSITY"] = "ERROR"

_TOKEN_HELP = "swarm token (default: SWARM_TOKEN; prefer it, flags show in `ps`)"


def env_name(flag: str) -> str:
    """`SWARM_METRICS_PORT` for `metrics-port`."""
    return "SWARM_" + flag.upper().replace("-", "_")


def env_default(flag: str, default: Any) -> Any:
    """The default of `--flag`: `SWARM_FLAG` if set (converted to the default's type)."""
    raw = os.environ.get(env_name(flag))
    if raw is None:
        return default
    return type(default)(raw) if default is not None else raw


def add_flag(
    p: argparse.ArgumentParser,
    flag: str,
    default: Any,
    help: str,
    *,
    env: str | None = None,
    **kw: Any,
) -> None:
    """`--flag`, defaulting from the environment, whose help names the variable: `SWARM_<FLAG>`,
    or `SWARM_<ENV>` for a flag several roles have that must not share one value (`--port`)."""
    name = env_name(env or flag)
    if env is not None and env_name(flag) in os.environ:
        # It would read as set for this role, and is read by none: say so, not bind elsewhere.
        print(f"swarm: {env_name(flag)} is not read; this command reads {name}", file=sys.stderr)
    help = f"{help} [env {name}]"
    p.add_argument(f"--{flag}", default=env_default(env or flag, default), help=help, **kw)


def add_switch(p: argparse.ArgumentParser, flag: str, help: str) -> None:
    """`--flag`, off unless given or its variable (`SWARM_<FLAG>`) is 1, true or yes."""
    name = env_name(flag)
    on = os.environ.get(name, "").strip().lower() in ("1", "true", "yes")
    p.add_argument(f"--{flag}", action="store_true", default=on, help=f"{help} [env {name}]")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default, shown once: not after a help that says it already ("default:
    ..."), nor when there is none to show (None, False, "")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help, default = action.help or "", action.default
        if default is None or default is False or default == "":
            return help
        if "default" in help.lower():
            return help
        return super()._get_help_string(action)


def add_token(p: argparse.ArgumentParser, help: str = _TOKEN_HELP) -> None:
    # No default from the environment: help output must not print the secret from SWARM_TOKEN.
    p.add_argument("--token", default=None, help=help)


def add_insecure_no_token(p: argparse.ArgumentParser) -> None:
    """`--insecure-no-token`: a server on an address other machines reach starts without a
    token (`swarm.net.tokens.refuse_open_host` refuses it otherwise)."""
    add_switch(
        p,
        "insecure-no-token",
        "listen on a --host other machines reach without a token: every caller who reaches the "
        "port is let in (only on a trusted network; loopback needs no token)",
    )


def token(args: argparse.Namespace) -> str | None:
    """`--token`, else `SWARM_TOKEN`, else None (no authentication)."""
    return args.token or os.environ.get(env_name("token")) or None


def add_metrics_token(p: argparse.ArgumentParser) -> None:
    # No default from the environment either: help output must not print the secret.
    p.add_argument(
        "--metrics-token",
        default=None,
        help="bearer token /metrics (and the scheduler's /sd) require, so that Prometheus need "
        "not hold the swarm token (default: SWARM_METRICS_TOKEN, else the swarm token; none "
        "without either)",
    )


def metrics_token(args: argparse.Namespace) -> str | None:
    """`--metrics-token`, else `SWARM_METRICS_TOKEN`, else None (the swarm token, if any)."""
    return args.metrics_token or os.environ.get(env_name("metrics-token")) or None
