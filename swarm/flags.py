"""Command-line flags that default from the environment: `--device` from `SWARM_DEVICE`, and so on.
Every role's `cli.py` declares its flags with these, so the rule is the same for all commands;
`HelpFormatter` shows each one's default once. Imported first by every command, it also sets the
process's environment default for gRPC's own logging (below)."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "MAX_SECONDS",
    "HelpFormatter",
    "add_flag",
    "add_insecure_no_token",
    "add_metrics_token",
    "add_secret",
    "add_switch",
    "add_token",
    "at_least",
    "env_default",
    "env_name",
    "metrics_token",
    "seconds",
    "secret",
    "token",
    "warn_if_url_password",
]

# gRPC's core logs every failed TLS handshake (a client without TLS, say) as raw lines on stderr
# at its INFO level, which it reads from GRPC_VERBOSITY once, when grpc is first imported. Every
# `swarm` command imports this module before grpc, so the default is set here: the side whose
# call failed says why in its own words (`swarm.net.tls_mismatch`). GRPC_VERBOSITY=INFO brings
# the core's lines back.
if not os.environ.get("GRPC_VERBOSITY"):
    os.environ["GRPC_VERBOSITY"] = "ERROR"

_TOKEN_HELP = "swarm token (default: SWARM_TOKEN)"


# A deadline or a pause at most (s). gRPC turns a deadline into nanoseconds from now: past
# ~9.2e9 s (and at inf, or any negative) a call failed at once as "did not answer in time"
# without being sent; a pause of 0 polled the scheduler in a tight loop.
MAX_SECONDS = 86400.0


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0 and at most a day."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_SECONDS:  # NaN fails it too
        raise argparse.ArgumentTypeError(
            f"{text!r}: a number of seconds > 0 and <= {MAX_SECONDS:g}"
        )
    return value


def at_least(least: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `least`."""

    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"{text!r}: an integer >= {least}")
        return value

    integer.__name__ = f"an integer >= {least}"  # argparse names a type by it in its errors
    return integer


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
    # A typed flag's variable is parsed by its type, as its value on the command line is:
    # `SWARM_TIMEOUT=inf` is refused as `--timeout inf` is.
    raw = os.environ.get(name)
    typed = raw is not None and "type" in kw
    p.add_argument(
        f"--{flag}", default=raw if typed else env_default(env or flag, default), help=help, **kw
    )


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


def add_secret(p: argparse.ArgumentParser, flag: str, help: str) -> None:
    """`--FLAG SECRET` and `--FLAG-file PATH` (default `SWARM_FLAG_FILE`); `secret` reads them,
    else `SWARM_FLAG`. No default from the environment for the secret itself: help output must
    not print it."""
    p.add_argument(f"--{flag}", default=None, help=f"{help}; shows in `ps`: prefer --{flag}-file")
    add_flag(p, f"{flag}-file", None, f"a file holding --{flag}, which `ps` does not show")


def secret(args: argparse.Namespace, flag: str) -> str | None:
    """`--FLAG` (warned of once: every local user sees it in `ps`), else the first line of
    `--FLAG-file` (what follows it, a comment or an old secret, is not part of it), else
    `SWARM_FLAG`, else None. A file that cannot be read as text, or whose first line is empty,
    stops the command (exit 2, the flag named: this floor has no `swarm.errors`)."""
    dest = flag.replace("-", "_")
    given = getattr(args, dest)
    if given:
        if not getattr(args, f"_{dest}_warned", False):
            setattr(args, f"_{dest}_warned", True)
            print(
                f"swarm: warning: --{flag} on the command line shows in `ps` to every local user; "
                f"give --{flag}-file PATH or {env_name(flag)} instead",
                file=sys.stderr,
            )
        return str(given)
    path = getattr(args, f"{dest}_file", None)
    if path:
        try:
            text = next(iter(Path(path).read_text().splitlines()), "").strip()
        except OSError as e:
            text, why = "", f"cannot read it ({e.strerror})"
        except UnicodeDecodeError:
            text, why = "", "it is not text: write the secret in it"
        else:
            why = "it is empty: write the secret in it"
        if not text:
            print(f"swarm: error: --{flag}-file {path}: {why}", file=sys.stderr)
            raise SystemExit(2)
        return text
    return os.environ.get(env_name(flag)) or None


def warn_if_url_password(args: argparse.Namespace, flag: str) -> None:
    """Warn when `--FLAG`'s URL, given on the command line (not by `SWARM_FLAG`), carries a
    password (`mqtt://peer:PASSWORD@host`): `ps` shows it to every local user."""
    url = getattr(args, flag.replace("-", "_")) or ""
    if url == os.environ.get(env_name(flag)) or urlsplit(url).password is None:
        return
    print(
        f"swarm: warning: the password in --{flag} shows in `ps` to every local user; "
        f"give the URL in {env_name(flag)} instead",
        file=sys.stderr,
    )


def add_token(p: argparse.ArgumentParser, help: str = _TOKEN_HELP) -> None:
    add_secret(p, "token", help)


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
    """`--token`, else `--token-file`, else `SWARM_TOKEN`, else None (no authentication)."""
    return secret(args, "token")


def add_metrics_token(p: argparse.ArgumentParser) -> None:
    add_secret(
        p,
        "metrics-token",
        "bearer token /metrics (and the scheduler's /sd) require, so that Prometheus need "
        "not hold the swarm token (default: SWARM_METRICS_TOKEN, else the swarm token; none "
        "without either)",
    )


def metrics_token(args: argparse.Namespace) -> str | None:
    """`--metrics-token`, else its file, else `SWARM_METRICS_TOKEN`, else None (the swarm
    token, if any)."""
    return secret(args, "metrics-token")
