"""The MQTT control plane's connection: a self-healing `Bus` over aiomqtt.

Topic names and payload types are `swarm.bus.topics`. A `Bus` owns one MQTT connection (a
`swarm.bus.link.Link`) in a background task. When the connection drops it reconnects with capped,
jittered exponential backoff, subscribes again, and re-publishes every retained message it
published, so a broker that restarted empty (no persistence) is refilled by its clients. Its
subscriptions and their dispatch are `swarm.bus.subscriptions`; the protocol, settings and errors
are `swarm.bus.api`, all importable from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Self

import aiomqtt
from google.protobuf.message import Message
from prometheus_client import REGISTRY, CollectorRegistry

from swarm.bus.api import (
    BusAuthError,
    BusLike,
    BusNotConnected,
    BusRefused,
    BusSettings,
    BusTakenOver,
    BusTlsMismatch,
    refusal_said,
)
from swarm.bus.link import Dialer, Link
from swarm.bus.subscriptions import Subscription, Subscriptions
from swarm.bus.takeover import DEFAULT_REMEDY, KEEPS, Takeover, TakeoverWatch
from swarm.bus.topics import (
    DEFAULT_PREFIX,
    BusError,
    Topics,
    check_pattern,
    check_topic,
    parse_broker_url,
)
from swarm.deadline import cancel_kept, within
from swarm.errors import ConfigError
from swarm.policy.backoff import Backoff

__all__ = [
    "Bus",
    "BusAuthError",
    "BusLike",
    "BusNotConnected",
    "BusRefused",
    "BusSettings",
    "BusTakenOver",
    "BusTlsMismatch",
    "Subscription",
    "refusal_said",
]

log = logging.getLogger(__name__)


class Bus:
    """A reconnecting MQTT client for the control plane; use as `async with Bus(...) as bus:`.

    `will` (topic, message) is registered as a retained last-will on every connect and, because a
    clean disconnect discards it, published by the bus itself when it closes. The MQTT username
    is the URL's user, else `username` (a peer's id, or "scheduler": the broker's ACL allows each
    user its own topics only), else "swarm" when there is a `token`; the token is the password.
    `registry` takes the `swarm_bus_malformed_messages_total` counter (default: the global
    registry). `server_name`: under TLS, the name the broker's certificate must hold when it is
    not the URL's host (`Dialer.create`). Another process connected with `client_id` makes the
    bus give up with `BusTakenOver` (`swarm.bus.takeover`), its message ending in `remedy`.
    """

    def __init__(
        self,
        url: str,
        client_id: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        will: tuple[str, Message] | None = None,
        token: str | None = None,
        username: str | None = None,
        registry: CollectorRegistry | None = None,
        settings: BusSettings | None = None,
        server_name: str | None = None,
        remedy: str = DEFAULT_REMEDY,
    ) -> None:
        if not client_id or len(client_id.encode()) > 65535:
            raise ConfigError("client_id must be a non-empty string, unique per broker")
        self.address = parse_broker_url(url)
        self.client_id = client_id
        self.settings = settings or BusSettings()
        self._remedy = remedy
        self._topics = Topics(prefix)
        self._dialer = Dialer.create(
            self.address,
            client_id,
            self.settings,
            will=will,
            token=token,
            username=username,
            server_name=server_name,
        )
        self._retained: dict[str, bytes] = {}  # last retained payload per topic; b"" = clear it
        self._subs = Subscriptions(client_id, self._topics, registry or REGISTRY)
        self._conn: Link | None = None
        self._ready = asyncio.Event()
        self._done = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._fatal: BusRefused | None = None
        self._last_error = "not tried yet"
        self._waits: list[float] = []  # when each pending `wait_connected` gives up

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
        self._subs.end_all(self._fatal)

    async def ended(self) -> BusRefused | None:
        """Wait until the bus stops for good: closed (None), or given up on (why: the login
        refused, or another process took its client id over)."""
        await self._done.wait()
        return self._fatal

    async def wait_connected(self, timeout: float) -> None:
        """Return once connected; else `BusRefused` (the login refused, TLS on one side only)
        or `BusNotConnected`. Meanwhile every failed attempt is logged, with the next."""
        give_up = asyncio.get_running_loop().time() + timeout
        self._waits.append(give_up)
        try:
            ready = await self._wait_ready(timeout)
        finally:
            self._waits.remove(give_up)
        if ready:
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
                await cancel_kept(
                    conn.client.publish(
                        topic,
                        payload,
                        qos=1 if retain else 0,
                        retain=retain,
                        timeout=max(deadline - loop.time(), 0.05),
                    )
                )
            except aiomqtt.MqttError as exc:
                conn.fail(exc)  # the link is broken; wait for the run loop to replace it
                with contextlib.suppress(TimeoutError):
                    await within(conn.closed.wait(), max(deadline - loop.time(), 0))
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
        sub = Subscription(
            pattern,
            owner=self.client_id,
            queue_size=self.settings.queue_size,
            forget=self._forget,
        )
        self._subs.add(sub)
        conn = self._conn
        if conn is not None:
            conn.spawn(self._subscribe(conn, pattern, [sub]))
        return sub

    # -------------------------------------------------------------------------------- internals

    def _forget(self, sub: Subscription) -> None:
        self._subs.discard(sub)
        conn = self._conn
        if conn is not None and all(s.pattern != sub.pattern for s in self._subs):
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

    async def _run(self) -> None:
        # Jitter keeps a swarm of peers from reconnecting to a restarted broker in lockstep.
        backoff = Backoff(self.settings.reconnect_initial_s, self.settings.reconnect_max_s)
        attempts = 0  # failed in a row
        takeover = TakeoverWatch(self.settings)
        loop = asyncio.get_running_loop()
        try:
            while not self._stop.is_set():
                try:
                    client = await self._dialer.connect()
                except BusRefused as exc:
                    self._fatal = exc
                    log.error("%s", exc)
                    return
                except Exception as exc:
                    self._last_error = str(exc) or type(exc).__name__
                    attempts += 1
                    takeover.refused()
                else:
                    backoff.reset()
                    attempts = 0
                    accepted = loop.time()
                    try:
                        await self._serve(client)
                    except Exception as exc:
                        self._last_error = str(exc) or type(exc).__name__
                        verdict = takeover.lost(loop.time() - accepted)
                        if verdict is not None:
                            yields = verdict is Takeover.GIVE_UP
                            remedy = self._remedy if yields else KEEPS
                            error = takeover.error(self.client_id, self.address.url, remedy)
                            log.error("bus %s: %s", self.client_id, error)
                            if yields:
                                self._fatal = error
                                return
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
                delay = backoff.next()
                if attempts:
                    self._log_attempt(attempts, delay)
                with contextlib.suppress(TimeoutError):
                    await within(self._stop.wait(), delay)
        finally:
            self._ready.clear()
            self._done.set()
            if self._fatal is not None:
                self._subs.end_all(self._fatal)

    def _log_attempt(self, attempts: int, delay: float) -> None:
        """A failed attempt to connect: a warning each time while someone waits for the
        connection (a process starting: silence would read as a hang); reconnecting in the
        background (announced by its "connection lost" warning), at attempts 1, 2, 4, 8, ..."""
        if not self._waits:
            level = logging.WARNING if attempts & (attempts - 1) == 0 else logging.DEBUG
            log.log(
                level,
                "bus %s: cannot connect to %s (%s): attempt %d failed, next in %.1f s",
                self.client_id,
                self.address.url,
                self._last_error,
                attempts,
                delay,
            )
            return
        left = min(self._waits) - asyncio.get_running_loop().time()
        log.warning(
            "bus %s: the broker at %s does not answer (%s): attempt %d failed, next in %.1f s; "
            "giving up in %.0f s",
            self.client_id,
            self.address.url,
            self._last_error,
            attempts,
            delay,
            max(left, 0.0),
        )

    async def _serve(self, client: aiomqtt.Client) -> None:
        """Restore state on a fresh connection and dispatch messages until it fails or we stop."""
        conn = Link(client)
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
            will = self._dialer.will
            if will is not None:
                # A clean DISCONNECT makes the broker discard the will: say it ourselves.
                with contextlib.suppress(Exception):
                    await cancel_kept(client.publish(will.topic, will.payload, qos=1, retain=True))
        finally:
            self._ready.clear()
            self._conn = None
            stop.cancel()
            await conn.aclose()
            for sub in self._subs:
                sub.subscribed.clear()

    async def _restore(self, conn: Link, subs: list[Subscription]) -> None:
        by_pattern: dict[str, list[Subscription]] = {}
        for sub in subs:
            by_pattern.setdefault(sub.pattern, []).append(sub)
        await asyncio.gather(*(self._subscribe(conn, p, group) for p, group in by_pattern.items()))
        # Loop until nothing changed meanwhile: a publish that timed out while we were here is
        # only in `_retained`, and must not be left out.
        sent: dict[str, bytes] = {}
        while todo := [(t, p) for t, p in self._retained.items() if sent.get(t) != p]:
            for topic, payload in todo:
                await cancel_kept(conn.client.publish(topic, payload, qos=1, retain=True))
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

    async def _subscribe(self, conn: Link, pattern: str, subs: list[Subscription]) -> None:
        if await self._subs.subscribe(conn.client, pattern, subs) and self._conn is conn:
            for sub in subs:
                sub.subscribed.set()

    async def _read(self, client: aiomqtt.Client) -> None:
        async for message in client.messages:
            self._subs.dispatch(message.topic.value, message.payload)
        raise aiomqtt.MqttError("message stream ended")
