"""The embedded broker's limits: how long a new connection may stay silent, how many it holds,
how large a packet it reads, how much it retains for peers and queues for each subscriber. The
broker runs inside the scheduler, so a stranger's idle or oversized connections, retained
messages or unread subscriptions must not take the scheduler's file descriptors or memory.

`PacketCap` enforces the size on the byte stream itself: it reads each packet's fixed header
before amqtt does and refuses a declared length over the cap, so an oversized packet ends that
connection before a byte of its body is buffered.
"""

from __future__ import annotations

import dataclasses
import logging
import resource

from amqtt.adapters import ReaderAdapter

from swarm.errors import ConfigError
from swarm.job.schema import MAX_SPEC_BYTES

__all__ = ["BrokerLimits", "PacketCap", "PacketTooLarge", "default_max_connections"]

log = logging.getLogger(__name__)

_MAX_LENGTH_BYTES = 4  # MQTT's remaining length takes at most four bytes
_KiB, _MiB = 1024, 1024 * 1024


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
    max_retained_bytes_per_user: int = 64 * _KiB
    """Retained payload bytes one user other than the scheduler may leave on the broker: a peer
    retains its announcement (or its last-will) on its own topic, a few hundred bytes."""
    max_retained_bytes: int = 32 * _MiB
    """Retained payload bytes of all users but the scheduler together: with the shared token
    anyone can log in as any number of made-up peers. A retained message past either bound is
    dropped (and logged); the scheduler's own (jobs, assignments, steps) are not counted. Each
    counts its topic and the broker's record beside its payload (`RetainedBudget`): this holds
    the announcements of the most peers a scheduler keeps (`scheduler.peer_room.MAX_PEERS`) at
    about 2 KiB each."""
    max_queued_bytes: int = 16 * _MiB
    """Payload bytes waiting to be sent to one subscriber (or for its acknowledgement); past it,
    or past `max_queued_messages`, the subscriber is disconnected: it stopped reading, and what
    it missed it gets again, as retained messages, when it reconnects. Messages already sent are
    not counted, nor the retained messages a new subscription receives (bounded above)."""
    max_queued_messages: int = 10_000
    max_queued_bytes_total: int = 128 * _MiB
    """Queued bytes of all subscribers together; past it, the one with the most queued is
    disconnected (an honest subscriber, reading, has next to none)."""

    def __post_init__(self) -> None:
        if not self.connect_timeout_s > 0:
            raise ConfigError(f"broker connect_timeout_s={self.connect_timeout_s}: must be > 0")
        for name in (
            "max_connections",
            "max_retained_bytes_per_user",
            "max_retained_bytes",
            "max_queued_bytes",
            "max_queued_messages",
            "max_queued_bytes_total",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"broker {name}={getattr(self, name)}: must be >= 1")
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
