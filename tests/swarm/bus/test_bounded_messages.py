"""What a peer announces is bounded where it enters every process that reads it (the bus's
dispatch): an address of a megabyte went into the scheduler's retained reachability report
twice, past the broker's packet cap, which closed the scheduler's connection at each reconnect;
and made-up peers each kept megabytes in the scheduler. A message dropped as malformed is said
once in a while, its topic escaped (a peer id may hold a newline, forging a log line)."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from swarm.bus.bounds import MAX_MEMORY_BYTES, MAX_PEER_MESSAGE_BYTES, MAX_TEXT_CHARS
from swarm.bus.subscriptions import Subscription, Subscriptions
from swarm.bus.topics import MESSAGE_TYPES, TopicKind, Topics
from swarm.job.schema import MAX_STAGES
from swarm.net.peer_ids import MAX_PEER_ID_CHARS
from swarm.proto import control_pb2 as cpb


def _subscribed() -> tuple[Subscriptions, Subscription, CollectorRegistry]:
    registry = CollectorRegistry()
    subs = Subscriptions("me", Topics(), registry)
    sub = Subscription(Topics().peer("+"), owner="me", queue_size=8, forget=subs.discard)
    subs.add(sub)
    return subs, sub, registry


def _malformed(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("swarm_bus_malformed_messages_total") or 0.0


@pytest.mark.parametrize(
    "field",
    [
        {"address": "x" * 1_050_000 + ":7000"},
        {"relay_address": "r" * 100_000 + ":7000"},
        {"device": "d" * 100_000},
        {"host_id": "h" * 100_000},
        {"samples_per_second": {k: 1.0 for k in range(100_000)}},
        {"memory_bytes": 2**64 - 1},  # every job would fit at submit (`scheduler.admission`)
    ],
)
def test_an_announcement_past_its_bounds_is_dropped_as_malformed(field: dict[str, object]) -> None:
    subs, sub, registry = _subscribed()
    topics = Topics()
    big = cpb.PeerAnnouncement(peer="f", state=cpb.PEER_STATE_JOINING, **field)  # type: ignore[arg-type]
    subs.dispatch(topics.peer("f"), big.SerializeToString())
    fine = cpb.PeerAnnouncement(peer="g", address="g.example.com:7000", device="cuda:0")
    subs.dispatch(topics.peer("g"), fine.SerializeToString())
    assert _malformed(registry) == 1
    assert sub._queue.qsize() == 1 and sub._queue.get_nowait()[1].peer == "g"  # type: ignore[index]


def test_malformed_messages_are_said_once_in_a_while_with_their_topic_escaped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="swarm.bus.subscriptions")
    subs, _, registry = _subscribed()
    topic = Topics().peer("a\nERROR scheduler: forged")
    for _ in range(1000):
        subs.dispatch(topic, b"\xff")
    assert _malformed(registry) == 1000
    lines = [r.getMessage() for r in caplog.records]
    assert 1 <= len(lines) <= 2 and not any("\n" in line for line in lines), lines
    assert "a\\nERROR" in lines[0], lines


class _Counted:
    """A peer announcement's type whose decodes are counted."""

    decoded = 0

    @classmethod
    def FromString(cls, payload: bytes) -> cpb.PeerAnnouncement:
        cls.decoded += 1
        return cpb.PeerAnnouncement.FromString(payload)


def test_a_peer_message_past_its_size_is_dropped_before_it_is_decoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """139,000 sparse stages (2 MB, under the packet cap) took a quarter second to decode on
    every reader's event loop, before its bounds refused it."""
    monkeypatch.setitem(MESSAGE_TYPES, TopicKind.PEER, _Counted)
    subs, sub, registry = _subscribed()
    sparse = {1_000_000 + k: 1.0 for k in range(139_000)}
    big = cpb.PeerAnnouncement(peer="f", samples_per_second=sparse)
    assert len(big.SerializeToString()) > MAX_PEER_MESSAGE_BYTES
    subs.dispatch(Topics().peer("f"), big.SerializeToString())
    assert _malformed(registry) == 1 and _Counted.decoded == 0
    assert sub._queue.qsize() == 0


def test_the_largest_honest_announcement_fits() -> None:
    """Every text at its bound and every stage measured: within the size a peer's message has."""
    texts = {
        f.name: "x" * MAX_TEXT_CHARS
        for f in cpb.PeerAnnouncement.DESCRIPTOR.fields
        if f.type == f.TYPE_STRING
    }
    texts["peer"] = "p" * MAX_PEER_ID_CHARS  # the topic's, a peer id
    largest = cpb.PeerAnnouncement(
        **texts,  # type: ignore[arg-type]
        samples_per_second={2**32 - 1 - k: 1e300 for k in range(MAX_STAGES)},
        memory_bytes=MAX_MEMORY_BYTES,
        stage=2**32 - 1,
        throttle=1e300,
        time=1e300,
        upload_bytes_per_second=1e300,
        download_bytes_per_second=1e300,
    )
    assert largest.ByteSize() <= MAX_PEER_MESSAGE_BYTES
    subs, sub, registry = _subscribed()
    subs.dispatch(Topics().peer(largest.peer), largest.SerializeToString())
    assert _malformed(registry) == 0 and sub._queue.qsize() == 1


def test_fields_a_reader_does_not_know_are_not_kept() -> None:
    """An announcement with an unknown field of 20 kB passed the bounds (they read the known
    fields) and the scheduler kept it whole, for each made-up peer."""
    subs, sub, _ = _subscribed()
    fine = cpb.PeerAnnouncement(peer="g", address="g.example.com:7000")
    unknown = b"\xc2\x3e" + _varint(20_000) + b"u" * 20_000  # field 1000, length-delimited
    subs.dispatch(Topics().peer("g"), fine.SerializeToString() + unknown)
    (_, got) = sub._queue.get_nowait()  # type: ignore[misc]
    assert got.address == "g.example.com:7000" and got.ByteSize() < 100


def test_a_load_report_past_its_bounds_is_dropped_as_malformed() -> None:
    """A load report's texts were not bounded at all: its job's was kept by the scheduler."""
    registry = CollectorRegistry()
    subs = Subscriptions("me", Topics(), registry)
    sub = Subscription(Topics().load("+"), owner="me", queue_size=8, forget=subs.discard)
    subs.add(sub)
    subs.dispatch(Topics().load("f"), cpb.LoadReport(job="j" * 1000).SerializeToString())
    subs.dispatch(Topics().load("g"), cpb.LoadReport(job="j" * 64).SerializeToString())
    assert _malformed(registry) == 1
    assert sub._queue.qsize() == 1 and sub._queue.get_nowait()[1].peer == "g"  # type: ignore[index]


def test_a_peer_id_past_its_bound_in_a_topic_is_dropped_as_malformed() -> None:
    """The payload's peer was bounded, then replaced by the topic's, which nothing bounded: a
    login of 60,000 characters announced, and every reader kept its id (a placed peer's rounds
    then all failed as "a malformed round ticket")."""
    subs, sub, registry = _subscribed()
    long = "p" * (MAX_PEER_ID_CHARS + 1)
    subs.dispatch(Topics().peer(long), cpb.PeerAnnouncement(device="cpu").SerializeToString())
    assert _malformed(registry) == 1 and sub._queue.qsize() == 0


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def test_a_peer_id_with_a_control_character_in_a_topic_is_dropped_as_malformed() -> None:
    """A topic's peer id goes into log lines as it is (the registry's warnings): a newline in it
    forged a line there; no peer id holds one."""
    subs, sub, registry = _subscribed()
    forged = "a\nERROR scheduler: forged"
    subs.dispatch(Topics().peer(forged), cpb.PeerAnnouncement(device="cpu").SerializeToString())
    assert _malformed(registry) == 1 and sub._queue.qsize() == 0
