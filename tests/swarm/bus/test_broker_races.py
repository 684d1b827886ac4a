"""The embedded broker while its clients come and go at once: a client's connect walks every
topic anyone subscribes to (amqtt sends it their retained messages), awaiting on each, and a
SUBSCRIBE or a clean disconnect landing meanwhile broke that walk ("dictionary changed size
during iteration": an `ERROR asyncio` traceback in the scheduler's log, the client's connection
reset). Here the walk is held at its first topic while another client subscribes, with real
clients."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiomqtt
import pytest

from swarm.bus.broker import EmbeddedBroker

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0


async def test_a_subscribe_during_a_connect_breaks_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="asyncio")
    async with EmbeddedBroker("127.0.0.1", 0) as embedded:
        broker: Any = embedded._broker
        walking, resume = asyncio.Event(), asyncio.Event()
        original = broker._publish_retained_messages_for_subscription

        async def held(*args: Any) -> None:  # the walk awaits here on each topic
            if not walking.is_set():  # the first connect's walk, at its first topic
                walking.set()
                await resume.wait()
            await original(*args)

        async with aiomqtt.Client("127.0.0.1", embedded.port, identifier="a") as a:
            await a.subscribe("swarm/a")  # one topic to walk
            broker._publish_retained_messages_for_subscription = held
            connecting = asyncio.create_task(_connect(embedded.port, "b"))
            await asyncio.wait_for(walking.wait(), WAIT_S)
            async with aiomqtt.Client("127.0.0.1", embedded.port, identifier="c") as c:
                await c.subscribe("swarm/c")  # a topic more, mid-walk
                resume.set()
                assert await asyncio.wait_for(connecting, WAIT_S) == "connected"
    assert "client_connected_cb" not in caplog.text, caplog.text


async def _connect(port: int, identifier: str) -> str:
    async with aiomqtt.Client("127.0.0.1", port, identifier=identifier) as client:
        await client.publish("swarm/b", b"x", qos=1)  # its session outlived its connect
    return "connected"
