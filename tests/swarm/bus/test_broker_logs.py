"""What a stranger can repeat is logged rated by the embedded broker: one line per kind of
refusal every few seconds, not one per refused CONNECT or PUBLISH (a flood of them would fill the
disk and bury the lines an operator needs)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from swarm.bus.broker import EmbeddedBroker
from swarm.bus.limits import BrokerLimits
from swarm.bus.topics import Topics
from tests.support.buses import WAIT_S
from tests.support.raw_mqtt import RawClient, connect_packet, publish_packet, subscribe_packet

pytestmark = pytest.mark.timeout(60)

TOKEN = "s3cret"
TOPICS = Topics()


def _broker_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every warning the process logged, amqtt's own included: a line per refusal on any logger
    fills the disk alike."""
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.attack("N16")
async def test_messages_on_anothers_topics_are_logged_rated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """50 PUBLISHes of peer a on peer b's topic, and 50 retained load reports: dropped, and
    logged a line each kind (each was a warning of its own)."""
    caplog.set_level(logging.INFO)
    async with (
        EmbeddedBroker(token=TOKEN) as broker,
        await RawClient.open("127.0.0.1", broker.port) as a,
    ):
        await a.send(connect_packet("peer-a", username="a", password=TOKEN))
        assert await a.connack(WAIT_S) == 0
        for _ in range(50):
            await a.send(publish_packet(TOPICS.peer("b"), b"forged"))
            await a.send(publish_packet(TOPICS.load("a"), b"load", retain=True))
        await a.send(publish_packet(TOPICS.peer("a"), b"marker", retain=True))
        assert broker._broker is not None
        async with asyncio.timeout(WAIT_S):
            while TOPICS.peer("a") not in broker._broker.retained_messages:
                await asyncio.sleep(0.02)
    lines = _broker_warnings(caplog)
    assert len(lines) <= 4, "\n".join(lines[:10])
    assert any("not its topic" in line for line in lines)
    assert any("retains only its announcement" in line for line in lines)


@pytest.mark.attack("N16")
async def test_a_probes_connect_is_not_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """`swarm`'s broker probe (a CONNECT without client id or login) is refused by a broker
    with a token: logged at info, as a probe, not as a refused login."""
    caplog.set_level(logging.INFO)
    async with (
        EmbeddedBroker(token=TOKEN) as broker,
        await RawClient.open("127.0.0.1", broker.port) as probe,
    ):
        await probe.send(connect_packet(""))
        assert await probe.connack(WAIT_S) not in (0, None)
    assert not [line for line in _broker_warnings(caplog) if "refused" in line]
    assert any("probe" in r.getMessage() for r in caplog.records)


@pytest.mark.attack("N16")
async def test_refused_logins_are_one_line_on_any_logger(caplog: pytest.LogCaptureFixture) -> None:
    """30 CONNECTs with a wrong password: one rated line, naming the refusal (amqtt wrote a
    `Failed to initialize client session` warning for each as well)."""
    caplog.set_level(logging.INFO)
    async with EmbeddedBroker(token=TOKEN) as broker:
        for i in range(30):
            async with await RawClient.open("127.0.0.1", broker.port) as c:
                await c.send(connect_packet(f"x{i}", username="a", password="wrong"))
                assert await c.connack(WAIT_S) not in (0, None)
    lines = _broker_warnings(caplog)
    assert len(lines) <= 2, "\n".join(lines[:10])
    assert any("refused client" in line for line in lines)


@pytest.mark.attack("N16")
async def test_probes_and_silent_and_oversized_connects_are_rated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """20 broker probes, 10 connections that never send a CONNECT and 10 CONNECTs over the
    packet cap: no warning per connection on any logger, and each kind said once at least."""
    caplog.set_level(logging.INFO)
    limits = BrokerLimits(connect_timeout_s=0.3, max_packet_bytes=1024)
    async with EmbeddedBroker(token=TOKEN, limits=limits) as broker:
        for _ in range(20):
            async with await RawClient.open("127.0.0.1", broker.port) as probe:
                await probe.send(connect_packet(""))
                assert await probe.connack(WAIT_S) not in (0, None)

        async def silent() -> bool:
            async with await RawClient.open("127.0.0.1", broker.port) as client:
                return await client.closed_by_broker(WAIT_S)

        # at once: each is closed at the broker's 0.3 s, which one after another was 3 s
        assert all(await asyncio.gather(*(silent() for _ in range(10))))
        for i in range(10):
            async with await RawClient.open("127.0.0.1", broker.port) as big:
                await big.send(connect_packet(f"b{i}", username="x" * 4000, password=TOKEN))
                assert await big.closed_by_broker(WAIT_S)
    lines = _broker_warnings(caplog)
    assert len(lines) <= 3, "\n".join(lines[:10])
    said = [r.getMessage() for r in caplog.records if r.name.startswith("swarm.bus")]
    assert any("no CONNECT within" in line for line in said)
    assert any("packet" in line and "1024" in line for line in said), said


@pytest.mark.attack("N16")
async def test_amqtts_own_warnings_are_rated(caplog: pytest.LogCaptureFixture) -> None:
    """20 logged-in clients each sending a second CONNECT (amqtt logs an error for each, by its
    rule's number, and closes the connection): one line of amqtt's kind, not 20."""
    caplog.set_level(logging.INFO)
    async with EmbeddedBroker(token=TOKEN) as broker:
        for i in range(20):
            async with await RawClient.open("127.0.0.1", broker.port) as c:
                await c.send(connect_packet(f"peer-w{i}", username=f"w{i}", password=TOKEN))
                assert await c.connack(WAIT_S) == 0
                await c.send(connect_packet(f"peer-w{i}", username=f"w{i}", password=TOKEN))
                assert await c.closed_by_broker(WAIT_S)
    lines = _broker_warnings(caplog)
    assert len(lines) <= 2, "\n".join(lines[:10])
    assert any("MQTT-3.1.0-2" in line for line in lines), lines


async def test_an_unacknowledged_message_is_said_once_in_our_words(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 68 item 6: each outage put amqtt's internals in the scheduler's log at ERROR (`Task
    failed and will be skipped: ... TimeoutError('Timeout waiting for PUBACK ...')`), one per
    message. A subscriber at QoS 1 that never acknowledges (its router is off) and 3 messages
    to it: one WARNING in the swarm's words, nothing at ERROR."""
    caplog.set_level(logging.INFO)
    topic = TOPICS.peer("a")
    async with (
        EmbeddedBroker() as broker,
        await RawClient.open("127.0.0.1", broker.port) as mute,
        await RawClient.open("127.0.0.1", broker.port) as sender,
    ):
        await mute.send(connect_packet("mute"))
        assert await mute.connack(WAIT_S) == 0
        await mute.send(subscribe_packet(1, topic, qos=1))
        await sender.send(connect_packet("sender"))
        assert await sender.connack(WAIT_S) == 0
        await asyncio.sleep(0.5)  # the subscription in place
        for i in range(3):
            await sender.send(publish_packet(topic, b"%d" % i, qos=1, packet_id=i + 1))
        async with asyncio.timeout(30):  # amqtt waits 5 s for each PUBACK
            while not any("did not acknowledge" in r.getMessage() for r in caplog.records):
                await asyncio.sleep(0.1)
        # The other messages' timeouts too: amqtt sends each message to a subscriber in a task
        # of its own, all three at once, so theirs come with the first (a fixed 6 s waited them).
        assert broker._broker is not None
        tasks = broker._broker._tasks_queue
        async with asyncio.timeout(30):
            while not all(task.done() for task in tasks):
                await asyncio.sleep(0.1)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors
    said = [line for line in _broker_warnings(caplog) if "PUBACK" in line or "acknowledge" in line]
    assert len(said) == 1 and "PUBACK" not in said[0], said
