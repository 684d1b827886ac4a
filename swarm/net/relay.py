"""STAND-IN for helper "relay"'s `swarm.net.relay` (issue 42): only so that the stage server's
`--relay` imports and its unit tests run on this branch. It listens and closes each connection; it
carries nothing. The lead takes relay's real module in its place at the merge."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

__all__ = ["RelayLimits", "RelayServer"]


@dataclass(frozen=True)
class RelayLimits:
    """What one relay carries at most."""

    max_peers: int = 64  # NAT'd peers attached at once
    max_calls: int = 256  # calls carried at once, over all peers


class RelayServer:
    def __init__(self, token: str | None, limits: RelayLimits) -> None:
        self.token, self.limits = token, limits
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on `host:port` (0: any free port); the bound port."""

        async def close(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()

        self._server = await asyncio.start_server(close, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
