"""Each subscriber's queue in the embedded broker, bounded. amqtt sends every message to every
matching subscriber as a task that waits for the subscriber's socket (and, at QoS 1, its
acknowledgement), holding the message meanwhile; a subscriber that never reads made the broker,
inside the scheduler, hold every message published after it stopped (43 -> 622 MiB).

Here each connection's `Outbox` counts what is waiting for it; past `max_queued_bytes` or
`max_queued_messages` the connection is closed (what it missed it gets again as retained
messages when it reconnects, where dropping messages would leave it silently behind), and past
`max_queued_bytes_total` across all subscribers the one with the most waiting is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Callable

from amqtt.adapters import StreamWriterAdapter
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.session import OutgoingApplicationMessage

from swarm.bus.limits import BrokerLimits
from swarm.ops.rated import RatedLog

__all__ = ["AbortableWriter", "BoundedHandler", "Outbox", "Outboxes"]

log = logging.getLogger(__name__)


class AbortableWriter(StreamWriterAdapter):
    """amqtt's stream writer, which the broker can cut off: once aborted every write is dropped
    (amqtt's own flag), so the deliveries still queued end at once, without writing to a closed
    socket (asyncio logs a warning for each such write), and the connection is reset, so that
    what the kernel still holds for a subscriber that does not read (megabytes) goes too."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        super().__init__(writer)
        self.stream = writer
        self.outbox: Outbox | None = None  # what waits for this connection, once it is known
        self.deadline: float | None = None  # (loop time) its CONNECT's, handshake included

    def abort(self) -> None:
        self.is_closed = True
        sock = self.stream.get_extra_info("socket")
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.stream.transport.abort()


class Outbox:
    """What waits to be sent to one connection: `take` before a message is queued for it,
    `give` once it is sent (or dropped)."""

    def __init__(self, owner: Outboxes, name: str, abort: Callable[[], None]) -> None:
        self._owner, self.name, self._abort = owner, name, abort
        self.bytes = self.messages = 0
        self.closed = False

    def take(self, size: int) -> bool:
        """Count a message of `size` bytes; False (and the connection closing) when it is one
        too many for this subscriber, or for all of them and this one holds the most."""
        if self.closed:
            return False
        self.bytes += size
        self.messages += 1
        self._owner.total += size
        limits = self._owner.limits
        if self.bytes > limits.max_queued_bytes or self.messages > limits.max_queued_messages:
            self.close("limits.max_queued_bytes / max_queued_messages for one subscriber")
        elif self._owner.total > limits.max_queued_bytes_total:
            victim = self._owner.largest() or self
            victim.close("limits.max_queued_bytes_total for all subscribers")
        if self.closed:
            self.give(size)
            return False
        return True

    def give(self, size: int) -> None:
        self.bytes -= size
        self.messages -= 1
        self._owner.total -= size

    def close(self, bound: str) -> None:
        """Disconnect this subscriber: it does not read what is sent to it."""
        if not self.closed:
            self.closed = True
            self._owner.rated.warning(
                bound,
                "broker: disconnected %s: %d bytes in %d messages waiting for it, past %s",
                self.name,
                self.bytes,
                self.messages,
                bound,
            )
            self._abort()


class Outboxes:
    """Every connection's `Outbox`, and their total."""

    def __init__(self, limits: BrokerLimits) -> None:
        self.limits = limits
        self.total = 0
        self.rated = RatedLog(log)
        self._boxes: set[Outbox] = set()

    def open(self, name: str, abort: Callable[[], None]) -> Outbox:
        box = Outbox(self, name, abort)
        self._boxes.add(box)
        return box

    def discard(self, box: Outbox) -> None:
        self._boxes.discard(box)

    def largest(self) -> Outbox | None:
        """The open outbox with the most bytes waiting, if any is open."""
        return max((b for b in self._boxes if not b.closed), key=lambda b: b.bytes, default=None)


class BoundedHandler(BrokerProtocolHandler):
    """amqtt's broker-side protocol handler, each message it sends counted in its `outbox`. The
    retained messages a new subscription receives are not counted: they are bounded by what the
    broker retains, and amqtt sends them one subscription at a time."""

    outbox: Outbox | None = None
    # Whether its client may read a topic (`Gate.may_read`); None: everything. Checked here, the
    # one way out to a client, so a retained message a new subscription gets is held to it too.
    readable: Callable[[str], bool] | None = None

    async def mqtt_publish(
        self,
        topic: str,
        data: bytes | bytearray,
        qos: int | None,
        retain: bool,
        ack_timeout: int | None = None,
    ) -> OutgoingApplicationMessage:
        if self.readable is not None and not self.readable(topic):
            return OutgoingApplicationMessage(None, topic, qos, data, retain)  # not theirs
        box = self.outbox
        if box is None or retain:
            return await super().mqtt_publish(topic, data, qos, retain, ack_timeout)
        size = len(data)
        if not box.take(size):
            return OutgoingApplicationMessage(None, topic, qos, data, retain)  # not sent
        try:
            return await super().mqtt_publish(topic, data, qos, retain, ack_timeout)
        finally:
            box.give(size)
