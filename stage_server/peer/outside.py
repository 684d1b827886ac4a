"""Whether the world outside answers this peer: how a peer behind NAT whose relay is lost tells
the relay's death from its own outage (its router unplugged, its Wi-Fi or ISP down), by dialling
`outside` (the broker's host and port, `stage_server.peer.reachability`) at that moment."""

from __future__ import annotations

import asyncio
import contextlib

from swarm.deadline import within
from swarm.relay.attach import split_host_port

__all__ = ["OUTSIDE_TIMEOUT_S", "answers"]

OUTSIDE_TIMEOUT_S = 3.0
"""How long the dial of `outside` may take when a relay is lost: a link that is up answers (or
refuses) within it; one that is down answers nothing."""


async def answers(address: str, timeout_s: float = OUTSIDE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to `address` ("host:port") opens within `timeout_s`."""
    try:
        host, port = split_host_port(address)
        _, writer = await within(asyncio.open_connection(host, port), timeout_s)
    except (OSError, TimeoutError, ValueError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True
