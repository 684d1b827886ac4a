"""Command-line flags that default from the environment: `--device` from `SWARM_DEVICE`, and so on.
Every role's `cli.py` declares its flags with these, so the rule is the same for all commands."""

from __future__ import annotations

import argparse
import os
from typing import Any

__all__ = [
    "add_flag",
    "add_metrics_token",
    "add_token",
    "env_default",
    "env_name",
    "metrics_token",
    "token",
]

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


def add_flag(p: argparse.ArgumentParser, flag: str, default: Any, help: str, **kw: Any) -> None:
    """`--flag`, defaulting from the environment, whose help names the variable."""
    help = f"{help} [env {env_name(flag)}]"
    p.add_argument(f"--{flag}", default=env_default(flag, default), help=help, **kw)


def add_token(p: argparse.ArgumentParser, help: str = _TOKEN_HELP) -> None:
    # No default from the environment: help output must not print the secret from SWARM_TOKEN.
    p.add_argument("--token", default=None, help=help)


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
