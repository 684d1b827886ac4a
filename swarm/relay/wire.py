"""The bytes a relay and the peers it carries exchange: a request head (HTTP/1.1-like: a request
line, headers, a blank line), read bounded in size and time, and the splice that copies a tunnel
byte for byte, never reading more than a bounded amount ahead of the side it writes to.

Requests on a relay's one port (`swarm.relay.server`):
- `CONNECT host:port HTTP/1.1` + `Proxy-Authorization: Basic ...`: a caller's tunnel (what
  gRPC's `grpc.http_proxy` sends, and Prometheus for an https:// target); answered
  `HTTP/1.1 200` then spliced, or a 4xx/5xx whose reason phrase says why.
- `GET http://host:port/path HTTP/1.1` + `Proxy-Authorization`: what Prometheus sends a proxy for
  an http:// target; passed on in origin form (`GET /path`, `Connection: close`, no proxy
  headers) down a tunnel, whose answer is the peer's.
- `ATTACH peer SWARM-RELAY/1` + `X-Swarm-Address: host:port` (+ `X-Swarm-Metrics: host:port`
  when it serves /metrics): a NAT'd peer's control connection; then lines: relay `NONCE n`, peer
  `PROOF p`, relay `OK` (or `ERR why`; `OK ip` when the peer sent `X-Swarm-Seen-From: ?`:
  the source address its connection came from, its router's public one); after that the relay
  sends `OPEN call grpc` or `OPEN call metrics` (open a data connection to that server of yours
  for it) and `PING`, the peer answers `PONG`.
- `DATA call SWARM-RELAY/1` + `Authorization: Swarm proof`: the peer's data connection for
  `call`, spliced to the caller's tunnel.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "PROTOCOL",
    "Head",
    "HeadError",
    "address_key",
    "answer",
    "close",
    "linger",
    "origin_form",
    "read_head",
    "splice",
]

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


def address_key(address: str) -> tuple[str, int] | None:
    """`host:port` as compared with a peer's announced address (the host's case and an IPv6
    host's brackets aside); None when it is not one."""
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit() or len(address) > 300:
        return None
    return host.strip("[]").lower(), int(port)


_HOP = frozenset({"proxy-authorization", "proxy-connection", "connection", "keep-alive"})


def origin_form(head: Head) -> tuple[str, bytes] | None:
    """A plain HTTP proxy request (`GET http://host:port/path`): its target `host:port` and the
    head to pass on (`GET /path`, the proxy's own headers left out, one request per
    connection); None when its target is not an absolute http:// URL."""
    if not head.target.startswith("http://"):
        return None
    authority, slash, path = head.target[len("http://") :].partition("/")
    if not authority or "@" in authority:
        return None
    lines = [f"{head.method} /{path if slash else ''} {head.version}"]
    lines += [f"{k}: {v}" for k, v in head.headers.items() if k not in _HOP]
    return authority, "\r\n".join([*lines, "Connection: close", "", ""]).encode("latin-1")


class _Pump(asyncio.Protocol):
    """One side of a splice: what its transport receives is written to the other side's at once
    (no copy into a stream buffer, no task switch). Flow control is the transports' own: when
    the other side's write buffer passes its high-water mark, this side stops reading from its
    socket until it drains, so memory stays bounded whatever the two sides' speeds."""

    def __init__(self, count: Callable[[int], None], ended: asyncio.Future[None]) -> None:
        self.count, self.ended = count, ended
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.mine: asyncio.Transport | None = None
        self.other: asyncio.Transport | None = None

    def data_received(self, data: bytes) -> None:
        assert self.other is not None
        self.other.write(data)
        self.count(len(data))

    def eof_received(self) -> bool:
        self._end()
        return False  # close

    def connection_lost(self, exc: Exception | None) -> None:
        self._end()
        if not self.lost.done():
            self.lost.set_result(None)

    def pause_writing(self) -> None:  # this side's write buffer is full: stop reading the other
        if self.other is not None:
            self.other.pause_reading()

    def resume_writing(self) -> None:
        if self.other is not None and not self.other.is_closing():
            self.other.resume_reading()

    def _end(self) -> None:
        if not self.ended.done():
            self.ended.set_result(None)


def _take(
    stream: tuple[asyncio.StreamReader, asyncio.StreamWriter], pump: _Pump
) -> tuple[asyncio.Transport, bytes]:
    """Hand `stream`'s transport to `pump`; the bytes its reader had read past the head."""
    transport: Any = stream[1].transport
    # The head was read through a StreamReader, which may hold bytes that followed it (only
    # its private buffer says so): they are passed on first.
    leftover = bytes(getattr(stream[0], "_buffer", b""))
    transport.set_protocol(pump)
    pump.mine = transport
    return transport, leftover


async def splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    chunk: int,
    count: Callable[[int], None] = lambda n: None,
) -> None:
    """Copy a<->b until either side ends or fails; then close both (what was read is still
    written first). No half-closed tunnel lingers: gRPC's HTTP/2 never half-closes a
    connection, and a side that did could otherwise hold the tunnel's slot for ever. `chunk`
    bounds each transport's write buffer (its high-water mark)."""
    ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    pa, pb = _Pump(count, ended), _Pump(count, ended)
    ta, left_a = _take(a, pa)
    tb, left_b = _take(b, pb)
    pa.other, pb.other = tb, ta
    for transport in (ta, tb):
        transport.set_write_buffer_limits(high=chunk)
    for leftover, to in ((left_a, tb), (left_b, ta)):
        if leftover:
            to.write(leftover)
            count(len(leftover))
    for transport in (ta, tb):
        if transport.is_closing():  # gone while the head was read: the splice ends at once
            pa._end()
        else:
            transport.resume_reading()  # a StreamReader with a full buffer paused it
    try:
        await ended
    finally:
        # Closed here, not through the writers: their protocol was handed over, so only the
        # pumps hear the connections go.
        for transport in (ta, tb):
            transport.close()
        try:
            async with asyncio.timeout(1.0):  # a peer that stopped reading: its bytes dropped
                await asyncio.gather(pa.lost, pb.lost)
        except TimeoutError:
            ta.abort()
            tb.abort()


async def close(writer: asyncio.StreamWriter) -> None:
    """Close, not waiting long for a peer that stopped reading (its buffered bytes are dropped)."""
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    except TimeoutError:
        writer.transport.abort()
    except Exception:  # reset while closing: closed all the same
        pass


_LINGER_S = 0.5  # how long a refused request's remaining bytes are read before closing


async def answer(writer: asyncio.StreamWriter, status: int, reason: str) -> None:
    """An HTTP answer whose reason phrase says why (gRPC shows callers the status only)."""
    phrase = reason.replace("\r", " ").replace("\n", " ")
    body = phrase.encode() + b"\n"
    writer.write(
        f"HTTP/1.1 {status} {phrase}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n".encode()
        + body
    )
    with contextlib.suppress(ConnectionError, OSError, TimeoutError):
        await asyncio.wait_for(writer.drain(), 1.0)


async def linger(reader: asyncio.StreamReader) -> None:
    """Read and drop what the client still sends, briefly, before closing: a socket closed with
    unread bytes is reset, and the reset can overtake the answer it was sent."""
    try:
        async with asyncio.timeout(_LINGER_S):
            while await reader.read(64 * 1024):
                pass
    except (ConnectionError, OSError, TimeoutError):
        pass
