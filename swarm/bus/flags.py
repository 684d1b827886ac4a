"""The flags of the broker's logins, shared by `swarm scheduler` (its embedded broker, and its own
login to any broker) and `swarm broker`. Light on purpose: `--help` imports no MQTT library."""

from __future__ import annotations

import argparse

from swarm.flags import add_secret, add_switch, secret

__all__ = ["add_login_flags", "scheduler_token"]


def add_login_flags(p: argparse.ArgumentParser) -> None:
    add_secret(
        p,
        "scheduler-token",
        "the scheduler's own MQTT password: only it publishes jobs and assignments, so "
        "the swarm token (every peer's) must not be it. Unset: an embedded broker makes one up "
        "for a scheduler in its process, and a scheduler dialling --broker sends the swarm "
        "token [env SWARM_SCHEDULER_TOKEN]",
    )
    add_switch(
        p,
        "use-identity-as-username",
        "embedded broker, with --tls-mutual: a client's MQTT user is the name of its "
        "certificate (`swarm certs issue NAME`), as Mosquitto's option of that name; the "
        "scheduler's certificate is then named scheduler, each peer's its --peer",
    )


def scheduler_token(args: argparse.Namespace) -> str | None:
    """`--scheduler-token`, else its file, else `SWARM_SCHEDULER_TOKEN`, else None."""
    return secret(args, "scheduler-token")
