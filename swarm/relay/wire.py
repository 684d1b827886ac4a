"""The bytes a relay and the peers it carries exchange: a request head (HTTP/1.1-like: a request
line, headers, a blank line), read bounded in size and time, and how a refused one is answered.
What a tunnel carries once joined is copied byte for byte by `swarm.relay.copier`.

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
from dataclasses import dataclass, field

from swarm.deadline import within

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
    # ASCII digits only: "²" is a digit to `isdigit` and none to `int`; "١٢" is 12 to both
    if not colon or not host or not (port.isascii() and port.isdigit()) or len(address) > 300:
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


async def close(writer: asyncio.StreamWriter) -> None:
    """Close, not waiting long for a peer that stopped reading (its buffered bytes are dropped)."""
    writer.close()
    try:
        await within(writer.wait_closed(), 1.0)
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
        await within(writer.drain(), 1.0)


async def linger(reader: asyncio.StreamReader) -> None:
    """Read and drop what the client still sends, briefly, before closing: a socket closed with
    unread bytes is reset, and the reset can overtake the answer it was sent."""
    try:
        async with asyncio.timeout(_LINGER_S):
            while await reader.read(64 * 1024):
                pass
    except (ConnectionError, OSError, TimeoutError):
        pass
