"""The MQTT control plane's connection: a self-healing `Bus` over aiomqtt.

Topic names and payload types are `swarm.topics`. A `Bus` owns one MQTT connection in a
background task. When the connection drops it reconnects with exponential backoff, subscribes
again, and re-publishes every retained message it published, so a broker that restarted empty (no
persistence) is refilled by its clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import ssl
import weakref
from collections.abc import AsyncIterator, Coroutine
from typing import Any, Protocol, Self

import aiomqtt
from aiomqtt.exceptions import MqttConnectError
from google.protobuf.message import DecodeError, Message
from prometheus_client import REGISTRY, CollectorRegistry, Counter

from swarm.errors import ConfigError
from swarm.topics import (
    DEFAULT_PREFIX,
    MESSAGE_TYPES,
    BusError,
    TopicError,
    Topics,
    check_pattern,
    check_topic,
    parse_broker_url,
    topic_matches,
)

__all__ = [
    "Bus",
    "BusAuthError",
    "BusLike",
    "BusNotConnected",
    "BusSettings",
    "Subscription",
]

log = logging.getLogger(__name__)

# CONNACK refusals that retrying cannot fix (MQTT 3.1.1 codes and paho's MQTT 5 equivalents).
_AUTH_REFUSALS = {4, 5, 134, 135}


class BusNotConnected(BusError):
    """No connection to the broker within the timeout, or the bus is closed."""


class BusAuthError(BusError):
    """The broker refused the credentials (token); reconnecting will not help."""


# -------------------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class BusSettings:
    """Timing of a `Bus`; every duration in seconds."""

    keepalive_s: int = 5
    """MQTT keepalive: a broker that hears nothing for 1.5x this declares the client dead and sends
    its last-will (a killed process is noticed at once: its socket closes)."""
    reconnect_initial_s: float = 0.2
    """First delay before reconnecting; doubles after every failed attempt."""
    reconnect_max_s: float = 5.0
    """Ceiling of the reconnect delay, so a restarted broker is found within about this long."""
    operation_timeout_s: float = 5.0
    """How long to wait for the broker's CONNACK, SUBACK or PUBACK before dropping the link."""
    publish_timeout_s: float = 10.0
    """How long `publish` waits for a connection (during a reconnect) before giving up."""
    close_timeout_s: float = 6.0
    """How long closing may take (publish the will, disconnect) before the task is cancelled."""
    queue_size: int = 10_000
    """Messages buffered per subscription; beyond it the oldest are dropped, with a log line."""

    def __post_init__(self) -> None:
        if self.keepalive_s < 1:
            raise ConfigError(f"keepalive_s={self.keepalive_s}: must be an integer >= 1 second")
        if not 0 < self.reconnect_initial_s <= self.reconnect_max_s:
            raise ConfigError("need 0 < reconnect_initial_s <= reconnect_max_s")
        for name in ("operation_timeout_s", "publish_timeout_s", "close_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0 seconds")
        if self.queue_size < 1:
            raise ConfigError("queue_size must be >= 1")


_MALFORMED: weakref.WeakKeyDictionary[CollectorRegistry, Counter] = weakref.WeakKeyDictionary()


def _malformed_counter(registry: CollectorRegistry) -> Counter:
    # One counter per registry, shared by every Bus that reports into it.
    counter = _MALFORMED.get(registry)
    if counter is None:
        counter = Counter(
            "swarm_bus_malformed_messages_total",
            "MQTT messages dropped because their topic or payload could not be parsed",
            registry=registry,
        )
        _MALFORMED[registry] = counter
    return counter


# ---------------------------------------------------------------------------------- subscriptions


class Subscription:
    """The (topic, message) pairs arriving on one pattern, as an async iterator.

    Close it (`aclose`, `async with`, or `contextlib.aclosing`) when done; one that is merely
    dropped is forgotten by its bus when garbage-collected. Iteration ends when the bus closes.
    """

    def __init__(self, bus: Bus, pattern: str) -> None:
        self.pattern = pattern
        self._bus = bus
        self._queue: asyncio.Queue[tuple[str, Message] | None] = asyncio.Queue(
            bus.settings.queue_size
        )
        self._subscribed = asyncio.Event()
        self._ended = False
        self._error: BusError | None = None
        self._dropped = 0

    def _put(self, item: tuple[str, Message] | None) -> None:
        if self._queue.full():
            self._queue.get_nowait()  # the newest state matters more than the oldest
            self._dropped += 1
            if self._dropped in (1, 10, 100) or self._dropped % 1000 == 0:
                log.warning(
                    "bus %s: subscription %s is not read fast enough; %d messages dropped",
                    self._bus.client_id,
                    self.pattern,
                    self._dropped,
                )
        self._queue.put_nowait(item)

    def _end(self, error: BusError | None = None) -> None:
        if not self._ended:
            self._ended, self._error = True, error
            self._put(None)

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
            await asyncio.wait_for(self._subscribed.wait(), timeout)
        except TimeoutError:
            raise BusNotConnected(
                f"bus {self._bus.client_id}: {self.pattern} not subscribed within {timeout:.1f} s"
            ) from None

    def close(self) -> None:
        self._bus._forget(self)
        self._end()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


class BusLike(Protocol):
    """What pure logic needs from the bus; tests and the simulator substitute a fake."""

    @property
    def topics(self) -> Topics: ...

    async def publish(self, topic: str, message: Message | bytes, retain: bool = False) -> None: ...

    def subscribe(self, pattern: str) -> AsyncIterator[tuple[str, Message]]: ...


# ------------------------------------------------------------------------------------------ bus


class _Connection:
    """One live MQTT connection and the tasks (SUBSCRIBE calls, the reader) that die with it."""

    def __init__(self, client: aiomqtt.Client) -> None:
        self.client = client
        self.failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        self.closed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    def fail(self, exc: BaseException) -> None:
        if not self.failed.done():
            self.failed.set_result(exc)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(self._guard(coro))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self, keep: asyncio.Task[None], timeout: float) -> None:
        """Wait (bounded) for the calls in flight, all but `keep`."""
        pending = [t for t in self._tasks if t is not keep]
        if pending:
            await asyncio.wait(pending, timeout=timeout)

    async def _guard(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure on this link is healed by reconnecting
            self.fail(exc)

    async def aclose(self) -> None:
        self.closed.set()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class Bus:
    """A reconnecting MQTT client for the control plane; use as `async with Bus(...) as bus:`.

    `will` (topic, message) is registered as a retained last-will on every connect and, because a
    clean disconnect discards it, published by the bus itself when it closes. With `token`, the
    bus logs in as user "swarm" (or the URL's user) with the token as password. `registry` takes
    the `swarm_bus_malformed_messages_total` counter (default: the global registry).
    """

    def __init__(
        self,
        url: str,
        client_id: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        will: tuple[str, Message] | None = None,
        token: str | None = None,
        registry: CollectorRegistry | None = None,
        settings: BusSettings | None = None,
    ) -> None:
        if not client_id or len(client_id.encode()) > 65535:
            raise ConfigError("client_id must be a non-empty string, unique per broker")
        self.address = parse_broker_url(url)
        self.client_id = client_id
        self.settings = settings or BusSettings()
        self._topics = Topics(prefix)
        self._username, self._password = self.address.username, self.address.password
        if token is not None:
            self._username, self._password = self.address.username or "swarm", token
        self._will: aiomqtt.Will | None = None
        if will is not None:
            check_topic(will[0])
            self._will = aiomqtt.Will(will[0], will[1].SerializeToString(), qos=1, retain=True)
        self._tls = ssl.create_default_context() if self.address.tls else None
        self._malformed = _malformed_counter(registry or REGISTRY)
        self._retained: dict[str, bytes] = {}  # last retained payload per topic; b"" = clear it
        self._subs: weakref.WeakSet[Subscription] = weakref.WeakSet()
        self._conn: _Connection | None = None
        self._ready = asyncio.Event()
        self._done = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._fatal: BusAuthError | None = None
        self._last_error = "not tried yet"

    @property
    def topics(self) -> Topics:
        return self._topics

    @property
    def ready(self) -> asyncio.Event:
        """Set while connected, with subscriptions and retained messages restored."""
        return self._ready

    @property
    def connected(self) -> bool:
        return self._ready.is_set()

    async def __aenter__(self) -> Self:
        if self._task is not None:
            raise BusError(f"bus {self.client_id}: a Bus is entered only once")
        self._task = asyncio.create_task(self._run(), name=f"bus {self.client_id}")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Publish the will, disconnect, stop the background task, and end all subscriptions."""
        self._closed = True
        self._stop.set()
        task = self._task
        if task is not None:
            try:
                await asyncio.wait({task}, timeout=self.settings.close_timeout_s)
            finally:
                if not task.done():
                    log.warning(
                        "bus %s: close took over %.1f s; cancelling",
                        self.client_id,
                        self.settings.close_timeout_s,
                    )
                    task.cancel()
                await asyncio.wait({task})
                if not task.cancelled() and task.exception() is not None:
                    log.error(
                        "bus %s: background task failed", self.client_id, exc_info=task.exception()
                    )
        for sub in list(self._subs):
            sub._end(self._fatal)

    async def wait_connected(self, timeout: float) -> None:
        """Return once connected; else `BusAuthError` (credentials refused) or `BusNotConnected`."""
        if await self._wait_ready(timeout):
            return
        if self._fatal is not None:
            raise self._fatal
        if self._closed:
            raise BusNotConnected(f"bus {self.client_id}: closed")
        raise BusNotConnected(
            f"bus {self.client_id}: not connected to {self.address.url} "
            f"within {timeout:.1f} s (last error: {self._last_error})"
        )

    async def publish(
        self,
        topic: str,
        message: Message | bytes,
        retain: bool = False,
        *,
        timeout: float | None = None,
    ) -> None:
        """Send `message` (a protobuf message, or raw bytes) to `topic`.

        During a reconnect this waits up to `timeout` (default `publish_timeout_s`) for the link.
        A retained message is remembered first and re-sent on every reconnect, so it reaches the
        broker eventually even when the wait times out (which then returns quietly); an empty
        payload clears the topic. A non-retained message that cannot be sent in time raises
        `BusNotConnected`.
        """
        if self._closed:
            raise BusNotConnected(f"bus {self.client_id}: closed; {topic} not sent")
        check_topic(topic)
        if isinstance(message, bytes | bytearray):
            payload = bytes(message)
        else:
            payload = message.SerializeToString()
        if retain:
            self._retained[topic] = payload
        loop = asyncio.get_running_loop()
        limit = self.settings.publish_timeout_s if timeout is None else timeout
        deadline = loop.time() + limit
        while True:
            if self._fatal is not None:
                raise self._fatal
            conn = self._conn
            if conn is None or not self._ready.is_set():
                if not await self._wait_ready(deadline - loop.time()):
                    if self._fatal is not None:
                        raise self._fatal
                    if retain:
                        log.info(
                            "bus %s: %s kept; it is sent when the broker is back",
                            self.client_id,
                            topic,
                        )
                        return
                    raise BusNotConnected(
                        f"bus {self.client_id}: not connected to "
                        f"{self.address.url} within {limit:.1f} s; {topic} "
                        f"not sent (last error: {self._last_error})"
                    )
                continue
            try:
                await conn.client.publish(
                    topic,
                    payload,
                    qos=1 if retain else 0,
                    retain=retain,
                    timeout=max(deadline - loop.time(), 0.05),
                )
            except aiomqtt.MqttError as exc:
                conn.fail(exc)  # the link is broken; wait for the run loop to replace it
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(conn.closed.wait(), max(deadline - loop.time(), 0))
                continue
            if retain and not payload and self._retained.get(topic) == b"":
                del self._retained[topic]  # cleared on the broker: nothing to restore
            return

    def subscribe(self, pattern: str) -> Subscription:
        """Iterate over (topic, message) on `pattern`; the message type follows the topic kind.

        Malformed payloads are dropped (logged and counted); cleared retained topics are skipped.
        Retained state is delivered again after each reconnect, so consumers must be idempotent.
        """
        if self._closed:
            raise BusNotConnected(f"bus {self.client_id}: closed")
        check_pattern(pattern)
        sub = Subscription(self, pattern)
        self._subs.add(sub)
        conn = self._conn
        if conn is not None:
            conn.spawn(self._subscribe(conn, pattern, [sub]))
        return sub

    # -------------------------------------------------------------------------------- internals

    def _forget(self, sub: Subscription) -> None:
        self._subs.discard(sub)
        conn = self._conn
        if conn is not None and all(s.pattern != sub.pattern for s in list(self._subs)):
            conn.spawn(conn.client.unsubscribe(sub.pattern))

    async def _wait_ready(self, timeout: float) -> bool:
        if self._ready.is_set():
            return True
        if timeout <= 0 or self._done.is_set():
            return False
        waiters = {asyncio.create_task(self._ready.wait()), asyncio.create_task(self._done.wait())}
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
        return self._ready.is_set()

    def _new_client(self) -> aiomqtt.Client:
        return aiomqtt.Client(
            self.address.host,
            self.address.port,
            username=self._username,
            password=self._password,
            identifier=self.client_id,
            will=self._will,
            clean_session=True,  # subscriptions are restored by the bus itself
            keepalive=self.settings.keepalive_s,
            timeout=self.settings.operation_timeout_s,
            tls_context=self._tls,
        )

    async def _run(self) -> None:
        delay = self.settings.reconnect_initial_s
        try:
            while not self._stop.is_set():
                client = self._new_client()
                try:
                    await client.__aenter__()
                except Exception as exc:
                    self._last_error = str(exc) or type(exc).__name__
                    rc = getattr(exc, "rc", None)
                    if isinstance(exc, MqttConnectError) and (
                        getattr(rc, "value", rc) in _AUTH_REFUSALS
                    ):
                        self._fatal = BusAuthError(
                            f"bus {self.client_id}: {self.address.url} refused the credentials "
                            f"({exc}); check the token"
                        )
                        log.error("%s", self._fatal)
                        return
                    _abandon(client)
                    log.debug(
                        "bus %s: cannot connect to %s: %s", self.client_id, self.address.url, exc
                    )
                else:
                    delay = self.settings.reconnect_initial_s
                    try:
                        await self._serve(client)
                    except Exception as exc:
                        self._last_error = str(exc) or type(exc).__name__
                        log.warning(
                            "bus %s: connection to %s lost (%s); reconnecting",
                            self.client_id,
                            self.address.url,
                            self._last_error,
                        )
                    finally:
                        with contextlib.suppress(Exception):
                            await client.__aexit__(None, None, None)
                if self._stop.is_set():
                    break
                # Jitter keeps a swarm of peers from reconnecting to a restarted broker in lockstep.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, self.settings.reconnect_max_s)
        finally:
            self._ready.clear()
            self._done.set()
            if self._fatal is not None:
                for sub in list(self._subs):
                    sub._end(self._fatal)

    async def _serve(self, client: aiomqtt.Client) -> None:
        """Restore state on a fresh connection and dispatch messages until it fails or we stop."""
        conn = _Connection(client)
        # Snapshot and publish `_conn` together: subscriptions made later subscribe by themselves.
        subs = list(self._subs)
        self._conn = conn
        stop = asyncio.create_task(self._stop.wait())
        try:
            reader = conn.spawn(self._read(client))
            conn.spawn(self._restore(conn, subs))
            waiters: set[asyncio.Future[Any]] = {conn.failed, stop}
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            if conn.failed.done():
                raise conn.failed.result()
            # Let SUBSCRIBE/UNSUBSCRIBE calls finish first: amqtt leaks the connection's socket
            # when an UNSUBSCRIBE and the DISCONNECT arrive together.
            await conn.drain(reader, self.settings.operation_timeout_s)
            if self._will is not None:
                # A clean DISCONNECT makes the broker discard the will: say it ourselves.
                with contextlib.suppress(Exception):
                    await client.publish(self._will.topic, self._will.payload, qos=1, retain=True)
        finally:
            self._ready.clear()
            self._conn = None
            stop.cancel()
            await conn.aclose()
            for sub in list(self._subs):
                sub._subscribed.clear()

    async def _restore(self, conn: _Connection, subs: list[Subscription]) -> None:
        by_pattern: dict[str, list[Subscription]] = {}
        for sub in subs:
            by_pattern.setdefault(sub.pattern, []).append(sub)
        await asyncio.gather(*(self._subscribe(conn, p, group) for p, group in by_pattern.items()))
        # Loop until nothing changed meanwhile: a publish that timed out while we were here is
        # only in `_retained`, and must not be left out.
        sent: dict[str, bytes] = {}
        while todo := [(t, p) for t, p in self._retained.items() if sent.get(t) != p]:
            for topic, payload in todo:
                await conn.client.publish(topic, payload, qos=1, retain=True)
                sent[topic] = payload
                if not payload and self._retained.get(topic) == b"":
                    del self._retained[topic]
        self._ready.set()
        log.info(
            "bus %s: connected to %s (%d patterns subscribed, %d retained restored)",
            self.client_id,
            self.address.url,
            len(by_pattern),
            len(sent),
        )

    async def _subscribe(self, conn: _Connection, pattern: str, subs: list[Subscription]) -> None:
        granted = await conn.client.subscribe(pattern, qos=1)
        if any(getattr(g, "is_failure", False) or g == 0x80 for g in granted):
            error = BusError(f"bus {self.client_id}: the broker refused subscription {pattern}")
            log.error("%s", error)
            for sub in subs:
                self._subs.discard(sub)
                sub._end(error)
            return
        if self._conn is conn:
            for sub in subs:
                sub._subscribed.set()

    async def _read(self, client: aiomqtt.Client) -> None:
        async for message in client.messages:
            self._dispatch(message)
        raise aiomqtt.MqttError("message stream ended")

    def _dispatch(self, message: aiomqtt.Message) -> None:
        topic, payload = message.topic.value, message.payload
        if payload is None or payload == b"":
            return  # a cleared retained topic
        try:
            if not isinstance(payload, bytes | bytearray):
                raise DecodeError(f"payload of type {type(payload).__name__}")
            parsed = MESSAGE_TYPES[self._topics.parse(topic).kind].FromString(bytes(payload))
        except (TopicError, DecodeError) as exc:
            self._malformed.inc()
            log.warning(
                "bus %s: dropped a malformed message on %s (%r...): %s",
                self.client_id,
                topic,
                payload[:16] if isinstance(payload, bytes | bytearray) else payload,
                exc,
            )
            return
        targets = [sub for sub in list(self._subs) if topic_matches(topic, sub.pattern)]
        for i, sub in enumerate(targets):
            copy = parsed
            if i > 0:  # each subscriber gets its own message, free to mutate
                copy = type(parsed)()
                copy.CopyFrom(parsed)
            sub._put((topic, copy))


def _abandon(client: aiomqtt.Client) -> None:
    # aiomqtt leaves the socket open when the CONNACK never came; close it so the late CONNACK
    # cannot revive a zombie session under our client id.
    with contextlib.suppress(Exception):
        client._client.disconnect()
