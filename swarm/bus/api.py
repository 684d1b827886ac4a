"""What a user of the MQTT bus sees besides `swarm.bus.connection.Bus` itself: the `BusLike`
protocol pure
logic codes against (tests and the simulator substitute a fake), the bus's settings, and its
errors. Import them from `swarm.bus.connection`."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Iterator
from typing import Protocol

from google.protobuf.message import Message

from swarm.bus.topics import BusError, Topics
from swarm.errors import ConfigError

__all__ = [
    "BusAuthError",
    "BusLike",
    "BusNotConnected",
    "BusRefused",
    "BusSettings",
    "BusTakenOver",
    "BusTlsMismatch",
    "refusal_said",
]


class BusNotConnected(BusError):
    """No connection to the broker within the timeout, or the bus is closed."""


class BusRefused(BusError):
    """The broker will not take this client as it is set up; reconnecting will not help."""


class BusAuthError(BusRefused):
    """The broker refused the login: the user, or its password (the token)."""


class BusTlsMismatch(BusRefused):
    """TLS on one side only: the URL says mqtt:// to a TLS broker, or mqtts:// to a clear one."""


class BusTakenOver(BusRefused):
    """Another process connects with this client's id: a broker keeps one connection per client
    id (MQTT), so each login drops the other's, and the two would take turns for ever. MQTT 3.1.1
    tells the dropped client nothing; the pattern tells it (`BusSettings.takeover_after`)."""


@contextlib.contextmanager
def refusal_said() -> Iterator[None]:
    """Around a `TaskGroup` of tasks that use the bus: when they ended because the bus gave up
    for good (`BusRefused`: another process took its id, the login refused), raise that one
    error, which says what to do, rather than the group (a traceback)."""
    try:
        yield
    except BaseExceptionGroup as group:
        refused = group.subgroup(BusRefused)
        if refused is None:
            raise
        leaf: BaseException = refused
        while isinstance(leaf, BaseExceptionGroup):
            leaf = leaf.exceptions[0]
        raise leaf from None


class BusLike(Protocol):
    """What pure logic needs from the bus; tests and the simulator substitute a fake."""

    @property
    def topics(self) -> Topics: ...

    async def publish(self, topic: str, message: Message | bytes, retain: bool = False) -> None: ...

    def subscribe(self, pattern: str) -> AsyncIterator[tuple[str, Message]]: ...


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
    takeover_after: int = 3
    """Connections in a row the broker accepted at once and then dropped within
    `takeover_window_s` that mean another process logs in with this client id (each login of the
    other kicks this one off, and this one's reconnect kicks the other). The newcomer, whose
    connections never lasted past the window, gives up with `BusTakenOver`; the process that
    held the id before keeps it, and logs the takeover (`swarm.bus.takeover`)."""
    takeover_window_s: float = 2.0
    """How soon after being accepted a dropped connection counts towards `takeover_after`; the
    other process reconnects after `reconnect_initial_s`, well within it."""

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
        if self.takeover_after < 2 or self.takeover_window_s <= 0:
            raise ConfigError("need takeover_after >= 2 and takeover_window_s > 0")
