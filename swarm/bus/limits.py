"""The embedded broker's limits: how long a new connection may stay silent, how many it holds,
and how large a packet it reads. The broker runs inside the scheduler, so a stranger's idle or
oversized connections must not take the scheduler's file descriptors or memory.

`PacketCap` enforces the size on the byte stream itself: it reads each packet's fixed header
before amqtt does and refuses a declared length over the cap, so an oversized packet ends that
connection before a byte of its body is buffered.
"""

from __future__ import annotations

import dataclasses
import logging
import resource
import time

from amqtt.adapters import ReaderAdapter

from swarm.errors import ConfigError
from swarm.job.schema import MAX_SPEC_BYTES

__all__ = ["BrokerLimits", "PacketCap", "PacketTooLarge", "RefusalLog", "default_max_connections"]

log = logging.getLogger(__name__)

_MAX_LENGTH_BYTES = 4  # MQTT's remaining length takes at most four bytes


def default_max_connections() -> int:
    """Half the process's open-file limit (the rest is the scheduler's), at most 1024."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(16, min(1024, soft // 2))


@dataclasses.dataclass(frozen=True)
class BrokerLimits:
    """What one embedded broker allows; see `swarm.bus.broker.EmbeddedBroker`."""

    connect_timeout_s: float = 10.0
    """Seconds a new connection has to finish its TLS handshake and send its CONNECT; a
    connection still silent then is closed."""
    max_connections: int = dataclasses.field(default_factory=default_max_connections)
    """Connections held at once (logged in or not); one more is closed at once, and the clients
    already connected carry on. Default: half the open-file limit, at most 1024."""
    max_packet_bytes: int = 2 * MAX_SPEC_BYTES
    """The largest MQTT packet read (after its fixed header); a larger one closes its connection.
    The largest the swarm sends is a job announcement carrying its job file (`MAX_SPEC_BYTES`)."""

    def __post_init__(self) -> None:
        if not self.connect_timeout_s > 0:
            raise ConfigError(f"broker connect_timeout_s={self.connect_timeout_s}: must be > 0")
        if self.max_connections < 1:
            raise ConfigError(f"broker max_connections={self.max_connections}: must be >= 1")
        if self.max_packet_bytes < 1024:
            raise ConfigError(f"broker max_packet_bytes={self.max_packet_bytes}: must be >= 1024")


class PacketTooLarge(Exception):
    """A packet declared longer than `max_packet_bytes`; its connection is closed. Not one of
    amqtt's errors on purpose: amqtt's reader discards a packet on those and reads on (from the
    middle of this one); on any other exception it closes the connection."""


class PacketCap(ReaderAdapter):
    """`inner`, refusing a packet whose declared length exceeds `limit` bytes."""

    def __init__(self, inner: ReaderAdapter, limit: int) -> None:
        self._inner, self._limit = inner, limit
        self._header = b""  # the next packet's fixed header, read ahead, not yet handed out
        self._left = 0  # bytes of the current packet not yet handed out (header included)

    async def read(self, n: int = -1) -> bytes:
        if n < 0:  # amqtt's decoders always ask for a count
            return await self._inner.read(n)
        out = bytearray()
        while len(out) < n:
            if self._left == 0:
                await self._read_header()
            take = min(n - len(out), self._left)
            if self._header:
                chunk, self._header = self._header[:take], self._header[take:]
            else:
                chunk = await self._inner.read(take)
            out += chunk
            self._left -= len(chunk)
        return bytes(out)

    async def _read_header(self) -> None:
        header = bytearray(await self._inner.read(1))
        length, shift = 0, 0
        for _ in range(_MAX_LENGTH_BYTES):
            byte = (await self._inner.read(1))[0]
            header.append(byte)
            length |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        else:
            raise PacketTooLarge("a remaining length longer than four bytes (malformed)")
        if length > self._limit:
            raise PacketTooLarge(
                f"a {length}-byte packet exceeds the embedded broker's limit "
                f"(limits.max_packet_bytes={self._limit})"
            )
        self._header, self._left = bytes(header), len(header) + length

    def feed_eof(self) -> None:
        self._inner.feed_eof()


class RefusalLog:
    """Logs refused connections and logins at most once per `every_s`, with how many since: a
    flood of connections must not become a flood of log lines."""

    def __init__(self, every_s: float = 2.0) -> None:
        self._every_s, self._last, self._count = every_s, -float("inf"), 0

    def refused(self, what: str) -> None:
        self._count += 1
        now = time.monotonic()
        if now - self._last >= self._every_s:
            log.warning("broker: %s (%d such in the last %.0f s)", what, self._count, self._every_s)
            self._last, self._count = now, 0
