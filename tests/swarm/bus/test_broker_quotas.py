"""What a client can make the embedded broker (inside the scheduler) hold, with raw MQTT packets:
retained messages only where the swarm retains (announcements, wills, the scheduler's topics),
within a per-user and a total budget; and a subscriber that stops reading is disconnected once
its queue passes a bound, instead of growing the scheduler by every message sent meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Callable

import pytest
from prometheus_client import CollectorRegistry

from swarm.bus.broker import EmbeddedBroker
from swarm.bus.limits import BrokerLimits
from swarm.bus.outbox import Outboxes
from swarm.bus.retained_budget import RETAINED_ENTRY_BYTES, RetainedBudget
from swarm.bus.subscriptions import Subscription
from swarm.bus.topics import ANY, SCHEDULER_USER, Topics
from swarm.proto import control_pb2 as pb
from tests.support.buses import WAIT_S, bus, receive, receive_until
from tests.support.raw_mqtt import RawClient, Will, connect_packet, packet, publish_packet

pytestmark = pytest.mark.timeout(90)

QUIET_S = 0.5  # how long "nothing arrives" is watched
MALFORMED = "swarm_bus_malformed_messages_total"
TOKEN = "s3cret"  # the swarm's: every peer holds it
SCHEDULER_TOKEN = "sched-only"  # the scheduler's own
TOPICS = Topics()
KiB = 1024


def _subscribe_packet(pattern: str) -> bytes:
    """SUBSCRIBE (packet id 1) to `pattern` at QoS 0."""
    raw = pattern.encode()
    return packet(0x82, struct.pack("!HH", 1, len(raw)) + raw + b"\x00")


def _load_report(peer: str, size: int) -> bytes:
    """A LoadReport of about `size` bytes: the bulk is a field unknown to it (parsed, ignored)."""
    bulk = b"L" * size
    unknown = bytes([0xA2, 0x06]) + _varint(len(bulk)) + bulk  # field 100, length-delimited
    return pb.LoadReport(peer=peer).SerializeToString() + unknown


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, low = n >> 7, n & 0x7F
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _retained_bytes(broker: EmbeddedBroker) -> int:
    """What the broker's retained store holds, payload bytes."""
    assert broker._broker is not None
    return sum(len(m.data or b"") for m in broker._broker.retained_messages.values())


async def _login(broker: EmbeddedBroker, user: str) -> RawClient:
    client = await RawClient.open("127.0.0.1", broker.port)
    await client.send(connect_packet(f"peer-{user}", username=user, password=TOKEN))
    assert await client.connack(WAIT_S) == 0
    return client


async def _retained_on(broker: EmbeddedBroker, topic: str) -> None:
    """Wait until `topic` is retained: a client's earlier PUBLISHes were handled before it."""
    assert broker._broker is not None
    async with asyncio.timeout(WAIT_S):
        while topic not in broker._broker.retained_messages:
            await asyncio.sleep(0.02)


@pytest.mark.attack("N3")
async def test_load_reports_are_not_retained() -> None:
    """Retained made-up load topics (300 x 1.9 MiB grew the scheduler 43 -> 619 MiB, and every new
    subscriber to jobs/+/load/+ got them all): refused, as is retaining on the peer's own load
    topic (`peers/a/load`); the peer's announcement is still kept."""
    async with EmbeddedBroker(token=TOKEN, scheduler_token=SCHEDULER_TOKEN) as broker:
        async with await _login(broker, "a") as a:
            made_up = [f"{TOPICS.prefix}jobs/x{i}/load/a" for i in range(20)]  # the ACL's too
            for topic in [TOPICS.load("a"), *made_up]:
                await a.send(publish_packet(topic, b"L" * 64 * KiB, retain=True))
            await a.send(publish_packet(TOPICS.peer("a"), b"announced", retain=True))
            await _retained_on(broker, TOPICS.peer("a"))
        assert _retained_bytes(broker) == len(b"announced")
        async with bus(broker.url, "late", token=SCHEDULER_TOKEN, username=SCHEDULER_USER) as late:
            await late.wait_connected(WAIT_S)
            loads = late.subscribe(TOPICS.load(ANY))
            await loads.wait_subscribed(WAIT_S)
            with pytest.raises(TimeoutError):
                topic, _ = await receive(loads, QUIET_S)
                pytest.fail(f"{topic} was retained")


def _announcement(peer: str, size: int) -> bytes:
    return pb.PeerAnnouncement(peer=peer, address="x" * size).SerializeToString()


async def _announce(broker: EmbeddedBroker, peers: Subscription, user: str, size: int) -> None:
    """User `user` retains a `size`-byte announcement, then sends a marker, not retained, which
    `peers` receives once the broker has handled the announcement (one connection's messages are
    handled in order)."""
    async with await _login(broker, user) as client:
        await client.send(publish_packet(TOPICS.peer(user), _announcement(user, size), retain=True))
        done = pb.PeerAnnouncement(peer=user, address="done").SerializeToString()
        await client.send(publish_packet(TOPICS.peer(user), done))
        await receive_until(peers, lambda t, m: getattr(m, "address", "") == "done")


@pytest.mark.attack("N3")
async def test_retained_announcements_are_bounded_per_user_and_in_all() -> None:
    """A token holder may log in as any peer: many made-up peers each retaining a large
    announcement stop at the total budget, and one peer's oversized one is refused outright; an
    honest announcement, and the scheduler's own retained messages, still get in."""
    limits = BrokerLimits(max_retained_bytes_per_user=16 * KiB, max_retained_bytes=64 * KiB)
    async with (
        EmbeddedBroker(token=TOKEN, scheduler_token=SCHEDULER_TOKEN, limits=limits) as broker,
        bus(broker.url, "scheduler", token=SCHEDULER_TOKEN, username=SCHEDULER_USER) as sched,
    ):
        assert broker._broker is not None
        held = broker._broker.retained_messages
        await sched.wait_connected(WAIT_S)
        peers = sched.subscribe(TOPICS.peer(ANY))
        await peers.wait_subscribed(WAIT_S)
        await _announce(broker, peers, "big", 17 * KiB)  # past its own budget
        assert TOPICS.peer("big") not in held
        for i in range(10):  # 10 x 12 KiB: past the total of 64 KiB
            await _announce(broker, peers, f"u{i}", 12 * KiB)
        total = sum(len(m.data) for t, m in held.items() if t.startswith(f"{TOPICS.prefix}peers/"))
        assert total <= 64 * KiB, f"{total} bytes of peers' announcements retained"
        await _announce(broker, peers, "u0", 100)  # a smaller one of its own: room for it
        assert len(held[TOPICS.peer("u0")].data) < 200
        job = pb.JobAnnouncement(job="j", spec="s" * 100 * KiB)
        await sched.publish(TOPICS.job("j"), job, retain=True)
        await _retained_on(broker, TOPICS.job("j"))  # the scheduler's own: not the peers' budget


@pytest.mark.attack("N3")
async def test_a_subscriber_that_never_reads_is_disconnected() -> None:
    """A subscriber to everything that stops reading while a peer publishes 32 MiB: amqtt queued
    every message for it (the scheduler grew 43 -> 622 MiB); now it is disconnected past its
    queue's bound, and a subscriber that reads gets every message meanwhile."""
    reports = 1024  # of 31 KiB: 32 MiB in all
    limits = BrokerLimits(max_queued_bytes=2 * 1024 * KiB)
    async with (
        EmbeddedBroker(token=TOKEN, scheduler_token=SCHEDULER_TOKEN, limits=limits) as broker,
        bus(broker.url, "scheduler", token=SCHEDULER_TOKEN, username=SCHEDULER_USER) as sched,
        await RawClient.open("127.0.0.1", broker.port) as stalled,
    ):
        sock = stalled.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * KiB)
        await stalled.send(connect_packet("stalled", username="s", password=TOKEN))
        assert await stalled.connack(WAIT_S) == 0
        await stalled.send(_subscribe_packet(TOPICS.everything()))
        await sched.wait_connected(WAIT_S)
        everything = sched.subscribe(TOPICS.everything())
        await everything.wait_subscribed(WAIT_S)
        async with await _login(broker, "a") as a:
            load = _load_report("a", 31 * KiB)  # within what a reader takes from a peer
            for _ in range(reports):
                await a.send(publish_packet(TOPICS.load("a"), load))
            await a.send(publish_packet(TOPICS.peer("a"), _announcement("a", 0)))
            seen = 0
            async with asyncio.timeout(WAIT_S * 3):
                while (await receive(everything, WAIT_S * 3))[0] != TOPICS.peer("a"):
                    seen += 1
        assert seen == reports  # the reader missed nothing
        assert broker._broker is not None
        queued = sum(not t.done() for t in broker._broker._tasks_queue)
        assert await stalled.closed_by_broker(WAIT_S), f"{queued} deliveries still queued"


def test_past_the_total_the_subscriber_with_the_most_queued_goes() -> None:
    """The outboxes' arithmetic, alone: each subscriber within its own bound, all together past
    the total; the one holding the most is closed (and only it), then the next message counts."""
    limits = BrokerLimits(max_queued_bytes=1000, max_queued_bytes_total=1500)
    boxes = Outboxes(limits)
    closed: list[str] = []
    slow = boxes.open("slow", lambda: closed.append("slow"))
    fast = boxes.open("fast", lambda: closed.append("fast"))
    assert slow.take(900) and fast.take(100)
    fast.give(100)
    assert fast.take(500)  # 1400 in all: within
    assert fast.take(200)  # 1600: past the total; slow holds the most
    assert closed == ["slow"] and not slow.take(1)
    assert not fast.take(400)  # 1100 of its own: past its bound
    assert closed == ["slow", "fast"]
    assert boxes.total == 900 + 700  # what is still in flight, given back as it ends


def test_retained_budget_counts_the_topic_and_the_entry_not_the_payload_alone() -> None:
    """A retained message is kept under its topic, with the broker's own record of it: 10
    payload bytes on a topic of 900 were counted as 10."""
    budget = RetainedBudget(per_user=1000, total=10_000)
    assert budget.refusal("u", "t/" + "p" * 900, 10) is not None
    assert budget.refusal("u", "t/u", 10) is None
    budget.stored("u", "t/u", 10)
    assert budget.used == 10 + len("t/u") + RETAINED_ENTRY_BYTES
    budget.stored("u", "t/u", 0)  # cleared
    assert budget.used == 0


def _cost(topic: str, size: int) -> int:
    """What a retained message of `size` bytes on `topic` counts for."""
    return size + len(topic) + RETAINED_ENTRY_BYTES


def test_retained_budget_counts_replacements_and_clears() -> None:
    budget = RetainedBudget(per_user=_cost("t/a", 100), total=_cost("t/a", 100) + _cost("t/b", 50))
    assert budget.refusal("a", "t/a", 100) is None
    budget.stored("a", "t/a", 100)
    assert budget.refusal("a", "t/a", 90) is None  # replaces its own
    assert budget.refusal("a", "t/a2", 1) is not None  # past its own
    assert budget.refusal("b", "t/b", 60) is not None  # past the total
    budget.stored(None, "t/a", 5)  # the scheduler's now: not counted
    assert budget.used == 0 and budget.refusal("b", "t/b", 100) is None


@contextlib.asynccontextmanager
async def _scheduler_reading(
    pattern: str,
) -> AsyncIterator[tuple[EmbeddedBroker, Subscription, Callable[[], float]]]:
    """A broker with the swarm's token, the scheduler subscribed to `pattern` on it, and how
    many messages the scheduler's bus dropped as malformed so far."""
    registry = CollectorRegistry()
    async with (
        EmbeddedBroker(token=TOKEN, scheduler_token=SCHEDULER_TOKEN) as broker,
        bus(
            broker.url,
            "scheduler",
            token=SCHEDULER_TOKEN,
            username=SCHEDULER_USER,
            registry=registry,
        ) as sched,
    ):
        await sched.wait_connected(WAIT_S)
        sub = sched.subscribe(pattern)
        await sub.wait_subscribed(WAIT_S)
        yield broker, sub, lambda: registry.get_sample_value(MALFORMED) or 0.0


@pytest.mark.attack("N3")
async def test_a_peers_message_past_what_readers_take_is_not_sent_on() -> None:
    """Every reader drops a peer's message past `MAX_PEER_MESSAGE_BYTES` (`swarm.bus.bounds`);
    the embedded broker sent it on first, into each subscriber's outbox (64 subscribers of
    one 2 MiB message were past the outboxes' total, which closed an honest one)."""
    async with _scheduler_reading(TOPICS.load(ANY)) as (broker, loads, dropped):
        async with await _login(broker, "a") as a:
            await a.send(publish_packet(TOPICS.load("a"), _load_report("a", 40 * KiB)))
            fine = pb.LoadReport(peer="a", queue_depth=7).SerializeToString()
            await a.send(publish_packet(TOPICS.load("a"), fine))
            topic, report = await receive(loads)
        assert topic == TOPICS.load("a") and getattr(report, "queue_depth", 0) == 7
        assert dropped() == 0  # before: sent on, and dropped by the reader as malformed


@pytest.mark.attack("N3")
async def test_a_last_will_past_what_readers_take_is_not_sent_on() -> None:
    """The broker's drop covered what a peer publishes, not its last-will, which amqtt sends on
    as the connection ends: one of 40 KiB (under the per-user budget, retained) reached every
    subscriber, and every new one again, each dropping it."""
    async with _scheduler_reading(TOPICS.peer(ANY)) as (broker, peers, dropped):
        will = Will(TOPICS.peer("p"), _announcement("p", 40 * KiB))
        client = await RawClient.open("127.0.0.1", broker.port)
        await client.send(connect_packet("peer-p", username="p", password=TOKEN, will=will))
        assert await client.connack(WAIT_S) == 0
        await client.close()  # no DISCONNECT: the will is due
        async with await _login(broker, "q") as q:  # a marker after it, which arrives
            await q.send(publish_packet(TOPICS.peer("q"), _announcement("q", 10)))
            topic, _ = await receive(peers)
        assert topic == TOPICS.peer("q")
        assert broker._broker is not None
        assert TOPICS.peer("p") not in broker._broker.retained_messages
        assert dropped() == 0  # before: sent on, and dropped by the reader as malformed
