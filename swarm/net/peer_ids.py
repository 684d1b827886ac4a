"""What a peer id may be: 1 to `MAX_PEER_ID_CHARS` of `[A-Za-z0-9._-]`, as a stage server makes
its own (`stage_server.peer.identity`: `<hostname>-<random>`, the hostname's other characters
made `-`).

One rule, where three places held their own or none: a relay attaches only such an id, a round
ticket carries every member's (an owner reads at most this many characters of each), and
`--peer` took any string, so a peer named past the bound was placed and then failed every round
of its stage as "a malformed round ticket", naming honest owners. `--peer` is now checked as
it is read (`peer_id`)."""

from __future__ import annotations

import argparse
import re

__all__ = ["MAX_PEER_ID_CHARS", "is_peer_id", "peer_id"]

MAX_PEER_ID_CHARS = 128
_PEER_ID = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_PEER_ID_CHARS}}}")


def is_peer_id(value: str) -> bool:
    """Whether `value` is a peer id by the rule above."""
    return _PEER_ID.fullmatch(value) is not None


def peer_id(value: str) -> str:
    """`--peer`'s type: `value` itself, or empty (the id persisted in the cache directory); an
    argparse error naming the rule otherwise."""
    if value and not is_peer_id(value):
        raise argparse.ArgumentTypeError(
            f"{value[:40]!r}{'...' if len(value) > 40 else ''} is not a peer id: 1 to "
            f"{MAX_PEER_ID_CHARS} letters, digits, '.', '_' or '-'"
        )
    return value
