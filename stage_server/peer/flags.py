"""The flags every peer process takes (a stage server's and an aggregator's alike): who it is,
how it is reached and trusted."""

from __future__ import annotations

import argparse

from swarm.flags import add_flag, add_insecure_no_token, add_token
from swarm.net.invite import add_join_flag
from swarm.net.peer_ids import peer_id
from swarm.net.tls import add_tls_flags

__all__ = ["add_peer_flags"]


def add_peer_flags(p: argparse.ArgumentParser) -> None:
    """Who a peer is and how it is reached and trusted: its id, the swarm token, TLS, the host it
    listens on (a stage server's and an aggregator's alike)."""
    add_flag(
        p,
        "peer",
        "",
        "peer id, also its MQTT username: 1-128 of A-Z a-z 0-9 . _ - (default: persisted in "
        "the cache dir)",
        type=peer_id,
    )
    add_token(p)
    add_insecure_no_token(p)
    add_tls_flags(p)
    add_flag(p, "host", "127.0.0.1", "address to listen on (0.0.0.0 or :: for every interface)")
    add_join_flag(p)
