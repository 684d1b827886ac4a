"""A bus's subscriptions, and the dispatch of what arrives to them.

Each `Subscription` is an async iterator over (topic, message) with a bounded queue. `Subscriptions`
holds a bus's live ones and parses an incoming MQTT message once (topic kind -> payload type),
names its peer and job from the topic (never the payload's say), drops and counts a malformed one
(a payload naming another peer or job than its topic included), and gives every matching
subscription its own copy.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Self

import aiomqtt
from google.protobuf.message import DecodeError, Message
from prometheus_client import CollectorRegistry, Counter

from swarm.bus.api import BusNotConnected
from swarm.bus.bounds import check_bounds, check_size
from swarm.bus.topics import (
    MESSAGE_TYPES,
    BusError,
    TopicError,
    TopicInfo,
    Topics,
    topic_matches,
)
from swarm.deadline import cancel_kept, within
from swarm.ops.rated import RatedLog

__all__ = ["Subscription", "Subscriptions"]

log = logging.getLogger(__name__)


class Subscription:
    """The (topic, message) pairs arriving on one pattern, as an async iterator.

    Close it (`aclose`, `async with`, or `contextlib.aclosing`) when done; one that is merely
    dropped is forgotten by its bus when garbage-collected. Iteration ends when the bus closes.
    """

    def __init__(
        self,
        pattern: str,
        *,
        owner: str,
        queue_size: int,
        forget: Callable[[Subscription], None],
    ) -> None:
        self.pattern = pattern
        self._owner, self._forget = owner, forget  # the bus's client id; how it lets go of us
        self._queue: asyncio.Queue[tuple[str, Message] | None] = asyncio.Queue(queue_size)
        self.subscribed = asyncio.Event()
        """Set while the broker has acknowledged this pattern on the bus's current connection."""
        self._ended = False
        self._error: BusError | None = None
        self._dropped = 0

    def deliver(self, item: tuple[str, Message] | None) -> None:
        if self._queue.full():
            self._queue.get_nowait()  # the newest state matters more than the oldest
            self._dropped += 1
            if self._dropped in (1, 10, 100) or self._dropped % 1000 == 0:
                log.warning(
                    "bus %s: subscription %s is not read fast enough; %d messages dropped",
                    self._owner,
                    self.pattern,
                    self._dropped,
                )
        self._queue.put_nowait(item)

    def end(self, error: BusError | None = None) -> None:
        """End iteration (after what is queued), raising `error` if given."""
        if not self._ended:
            self._ended, self._error = True, error
            self.deliver(None)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> tuple[str, Message]:
        if self._ended and self._queue.empty():
            raise self._error or StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            raise self._error or StopAsyncIteration
        return item

    async def wait_subscribed(self, timeout: float) -> None:
        """Wait until the broker acknowledged this subscription on the current connection."""
        try:
            await within(self.subscribed.wait(), timeout)
        except TimeoutError:
            raise BusNotConnected(
                f"bus {self._owner}: {self.pattern} not subscribed within {timeout:.1f} s"
            ) from None

    def close(self) -> None:
        self._forget(self)
        self.end()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


_MALFORMED: weakref.WeakKeyDictionary[CollectorRegistry, Counter] = weakref.WeakKeyDictionary()


def _malformed_counter(registry: CollectorRegistry) -> Counter:
    # One counter per registry, shared by every Bus that reports into it.
    counter = _MALFORMED.get(registry)
    if counter is None:
        counter = Counter(
            "swarm_bus_malformed_messages_total",
            "MQTT messages dropped: topic or payload unparsable, or a payload naming another "
            "peer or job than its topic",
            registry=registry,
        )
        _MALFORMED[registry] = counter
    return counter


def _name_from_topic(message: Message, info: TopicInfo) -> None:
    """Give `message` the peer and job its topic names: the topic is who sent it (the broker's
    ACL lets a peer publish only on its own), the payload only claims. A payload that names
    another peer or job than its topic is refused (`DecodeError`), so no one updates another."""
    fields = message.DESCRIPTOR.fields_by_name
    for name, value in (("peer", info.peer), ("job", info.job)):
        if value is None or name not in fields:
            continue
        claimed = getattr(message, name)
        if claimed and claimed != value:
            raise DecodeError(f"its payload names {name} {claimed!r}, its topic {value!r}")
        setattr(message, name, value)


class Subscriptions:
    """A bus's live subscriptions, held weakly (a dropped one is forgotten), and the dispatch of
    incoming messages to them. `registry` takes the malformed-messages counter."""

    def __init__(self, owner: str, topics: Topics, registry: CollectorRegistry) -> None:
        self._owner, self._topics = owner, topics
        self._malformed = _malformed_counter(registry)
        self._said = RatedLog(log)
        self._dropped = 0  # malformed messages dropped, for the rated line (the counter's too)
        self._subs: weakref.WeakSet[Subscription] = weakref.WeakSet()

    def add(self, sub: Subscription) -> None:
        self._subs.add(sub)

    def discard(self, sub: Subscription) -> None:
        self._subs.discard(sub)

    def __iter__(self) -> Iterator[Subscription]:
        return iter(list(self._subs))  # a snapshot: callbacks may add or drop some meanwhile

    def __len__(self) -> int:
        return len(self._subs)

    def end_all(self, error: BusError | None = None) -> None:
        for sub in self:
            sub.end(error)

    async def subscribe(
        self, client: aiomqtt.Client, pattern: str, subs: list[Subscription]
    ) -> bool:
        """SUBSCRIBE to `pattern` for `subs`; whether the broker granted it (if not, they end with
        a BusError and are dropped)."""
        granted = await cancel_kept(client.subscribe(pattern, qos=1))
        if any(getattr(g, "is_failure", False) or g == 0x80 for g in granted):
            error = BusError(f"bus {self._owner}: the broker refused subscription {pattern}")
            log.error("%s", error)
            for sub in subs:
                self.discard(sub)
                sub.end(error)
            return False
        return True

    def dispatch(self, topic: str, payload: object) -> None:
        """Parse one MQTT message and deliver it to every subscription whose pattern matches.
        Its peer and job are the topic's (`_name_from_topic`)."""
        if payload is None or payload == b"":
            return  # a cleared retained topic
        try:
            if not isinstance(payload, bytes | bytearray):
                raise DecodeError(f"payload of type {type(payload).__name__}")
            info = self._topics.parse(topic)
            check_size(info, payload)  # before the decode: a large one holds the event loop
            parsed = MESSAGE_TYPES[info.kind].FromString(bytes(payload))
            check_bounds(parsed)
            _name_from_topic(parsed, info)
        except (TopicError, DecodeError) as exc:
            self._malformed.inc()  # each counted; said once in a while (a stranger repeats it)
            self._dropped += 1
            self._said.warning(
                "malformed",
                "bus %s: dropped a malformed message on %s (%r...): %s (%d so far)",
                self._owner,
                topic[:200].encode("unicode_escape").decode(),  # an id may hold a newline
                payload[:16] if isinstance(payload, bytes | bytearray) else payload,
                exc,
                self._dropped,
            )
            return
        targets = [sub for sub in self if topic_matches(topic, sub.pattern)]
        for i, sub in enumerate(targets):
            copy = parsed
            if i > 0:  # each subscriber gets its own message, free to mutate
                copy = type(parsed)()
                copy.CopyFrom(parsed)
            sub.deliver((topic, copy))
