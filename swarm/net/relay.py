"""STAND-IN for helper "relay"'s `swarm.net.relay` (issue 42): only so that the stage server's
`--relay` imports and its unit tests run on this branch. It listens and closes each connection; it
carries nothing. Its signature and `RelayLimits` are the real module's; the lead takes relay's
real module in its place at the merge."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry

__all__ = ["RelayLimits", "RelayServer"]


class Refusals(Protocol):
    def warning(self, key: Hashable, msg: str, *args: object) -> object: ...


@dataclass(frozen=True)
class RelayLimits:
    max_peers: int = 256  # peers attached at once
    max_tunnels_per_peer: int = 64  # a peer's concurrent tunnels (a gRPC channel uses one)
    max_tunnels: int = 1024  # tunnels in all (two descriptors each, and the peer's one)
    max_heads: int = 128  # connections still sending their request head
    head_timeout_s: float = 10.0  # to send a request head (and an attach's proof)
    max_head_bytes: int = 8192
    open_timeout_s: float = 10.0  # for the peer to open a tunnel's data connection
    ping_s: float = 10.0  # how often an attached peer is pinged
    dead_after_s: float = 35.0  # an attached peer silent this long is dropped
    chunk_bytes: int = 256 * 1024  # a splice's read; with the stream buffers, its memory bound


class RelayServer:
    def __init__(
        self,
        token: str | None,
        limits: RelayLimits | None = None,
        *,
        registry: CollectorRegistry | None = None,
        refusals: Refusals | None = None,
    ) -> None:
        self.token, self.limits = token or None, limits or RelayLimits()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        async def close(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()

        self._server = await asyncio.start_server(close, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
