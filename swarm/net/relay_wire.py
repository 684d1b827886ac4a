"""The bytes a relay and the peers it carries exchange: a request head (HTTP/1.1-like: a request
line, headers, a blank line), read bounded in size and time, and the splice that copies a tunnel
byte for byte, never reading more than a bounded amount ahead of the side it writes to.

Requests on a relay's one port (`swarm.net.relay`):
- `CONNECT host:port HTTP/1.1` + `Proxy-Authorization: Basic ...`: a caller's tunnel (what
  gRPC's `grpc.http_proxy` sends); answered `HTTP/1.1 200` then spliced, or a 4xx/5xx whose
  reason phrase says why.
- `ATTACH peer SWARM-RELAY/1` + `X-Swarm-Address: host:port`: a NAT'd peer's control connection;
  then lines: relay `NONCE n`, peer `PROOF p`, relay `OK` (or `ERR why`); after that the relay
  sends `OPEN call` (open a data connection for it) and `PING`, the peer answers `PONG`.
- `DATA call SWARM-RELAY/1` + `Authorization: Swarm proof`: the peer's data connection for
  `call`, spliced to the caller's tunnel.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["PROTOCOL", "Head", "HeadError", "close", "read_head", "splice"]

PROTOCOL = "SWARM-RELAY/1"


class HeadError(Exception):
    """A request head that cannot be served: `status` and `reason` answer it."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


@dataclass(frozen=True)
class Head:
    method: str
    target: str
    version: str
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names; one value each


async def read_head(reader: asyncio.StreamReader, max_bytes: int) -> Head:
    """The request head, at most `max_bytes` (431 past it); the caller bounds the time."""
    lines: list[str] = []
    size = 0
    while True:
        try:
            raw = await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError:
            raise HeadError(400, "connection closed before the request head ended") from None
        except asyncio.LimitOverrunError:
            raise HeadError(431, "request head too large") from None
        size += len(raw)
        if size > max_bytes:
            raise HeadError(431, f"request head over {max_bytes} bytes")
        line = raw.rstrip(b"\r\n").decode("latin-1")
        if not line:
            break
        lines.append(line)
    if not lines:
        raise HeadError(400, "empty request")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise HeadError(400, "malformed request line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        name = name.strip().lower()
        if not colon or not name:
            raise HeadError(400, "malformed header line")
        if name in headers:  # two credentials: which one was checked would be ambiguous
            raise HeadError(400, f"header {name} given twice")
        headers[name] = value.strip()
    return Head(parts[0], parts[1], parts[2], headers)


async def _pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    chunk: int,
    count: Callable[[int], None],
) -> None:
    """Copy until end of stream. `drain` waits while the writer's buffer is over its high-water
    mark, and the reader stops reading from its socket while its own buffer is full: memory
    stays bounded whatever the two sides' speeds."""
    while data := await reader.read(chunk):
        writer.write(data)
        count(len(data))
        await writer.drain()


async def splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    chunk: int,
    count: Callable[[int], None] = lambda n: None,
) -> None:
    """Copy a<->b until either side ends or fails; then close both (what was read is still
    written first). No half-closed tunnel lingers: gRPC's HTTP/2 never half-closes a
    connection, and a side that did could otherwise hold the tunnel's slot for ever."""
    pumps = [
        asyncio.create_task(_pump(a[0], b[1], chunk, count)),
        asyncio.create_task(_pump(b[0], a[1], chunk, count)),
    ]
    try:
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)  # a reset side's error is moot
        await close(a[1])
        await close(b[1])


async def close(writer: asyncio.StreamWriter) -> None:
    """Close, not waiting long for a peer that stopped reading (its buffered bytes are dropped)."""
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    except TimeoutError:
        writer.transport.abort()
    except Exception:  # reset while closing: closed all the same
        pass
