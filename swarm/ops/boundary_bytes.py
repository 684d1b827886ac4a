"""Bytes per token across a boundary, from what replicas say they sent (`BoundaryTraffic`, in
their load reports): the bytes over the tokens, summed over the replicas, each way. `swarm status`
(`client.boundaries`) and the scheduler's gauge (`scheduler.collector`) both read it so."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from swarm.proto import control_pb2 as cpb

__all__ = ["Way", "per_token"]

Way = Literal["forward", "backward"]


def per_token(sent: Iterable[cpb.BoundaryTraffic], way: Way) -> float | None:
    """Bytes per token the replicas' `sent` carried `way`; None: no token yet."""
    nbytes = tokens = 0
    for t in sent:
        nbytes += t.forward_bytes if way == "forward" else t.backward_bytes
        tokens += t.forward_tokens if way == "forward" else t.backward_tokens
    return nbytes / tokens if tokens else None
