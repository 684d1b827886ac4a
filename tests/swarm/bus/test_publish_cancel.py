"""A task cancelled while its publish is being confirmed is cancelled, not let go on.

aiomqtt waits for the broker's PUBACK with Python 3.11's `asyncio.wait_for`, which returns the
result instead of raising when the cancellation arrives after the confirmation was set but before
the waiter resumed (`swarm/deadline.py`). A scheduler's job task cancelled in that window went on
placing for a minute (docs/decisions.md, "Three test workers, tried again and taken back").
The window is hit here on purpose: the real client's PUBACK callback cancels the publisher right
after it has set the confirmation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from swarm.bus.broker import EmbeddedBroker
from swarm.bus.connection import Bus
from swarm.bus.topics import Topics
from swarm.proto import control_pb2 as pb
from tests.support.buses import WAIT_S, bus

pytestmark = pytest.mark.timeout(60)

TOPICS = Topics()


def _cancel_on_puback(b: Bus, victim: Callable[[], asyncio.Task[Any] | None]) -> list[int]:
    """Make `b`'s PUBACK callback cancel `victim()` right after aiomqtt set the publish's
    confirmation; the PUBACKs so handled."""
    conn = b._conn
    assert conn is not None, "connected first"
    paho = conn.client._client  # the paho client under aiomqtt: its callback is the window
    confirm = paho.on_publish
    seen: list[int] = []

    def on_publish(*args: Any) -> None:
        confirm(*args)
        task = victim()
        if task is not None:
            seen.append(args[2])
            task.cancel()

    paho.on_publish = on_publish
    return seen


async def test_a_cancellation_as_the_puback_comes_ends_the_publisher() -> None:
    async with EmbeddedBroker() as broker, bus(broker.url, "p1") as b:
        await b.wait_connected(WAIT_S)
        went_on = asyncio.Event()
        publisher: asyncio.Task[None] | None = None

        async def publish_then_go_on() -> None:
            await b.publish(TOPICS.peer("p1"), pb.PeerAnnouncement(address="a:1"), retain=True)
            went_on.set()  # the placement loop that kept running did this
            await asyncio.sleep(WAIT_S)

        seen = _cancel_on_puback(b, lambda: publisher)
        publisher = asyncio.create_task(publish_then_go_on())
        await asyncio.wait([publisher], timeout=WAIT_S)
        assert seen, "the PUBACK never came"
        assert publisher.done() and publisher.cancelled(), "the cancellation was lost"
        assert not went_on.is_set()


async def test_a_cleanup_that_publishes_after_its_cancellation_still_runs() -> None:
    """Only a cancellation that arrived during the publish is raised: a task that handled one
    before (a job saying it ended) publishes and goes on."""
    async with EmbeddedBroker() as broker, bus(broker.url, "p1") as b:
        await b.wait_connected(WAIT_S)
        cleaned = asyncio.Event()

        async def cancelled_then_clean_up() -> None:
            try:
                await asyncio.sleep(WAIT_S)
            finally:
                await b.publish(TOPICS.peer("p1"), pb.PeerAnnouncement(address="a:1"), retain=True)
                cleaned.set()

        task = asyncio.create_task(cancelled_then_clean_up())
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait([task], timeout=WAIT_S)
        assert task.done() and task.cancelled()
        assert cleaned.is_set(), "the cleanup's publish was cut short"
