"""What a peer announces is bounded where it enters every process that reads it (the bus's
dispatch): an address of a megabyte went into the scheduler's retained reachability report
twice, past the broker's packet cap, which closed the scheduler's connection at each reconnect;
and made-up peers each kept megabytes in the scheduler. A message dropped as malformed is said
once in a while, its topic escaped (a peer id may hold a newline, forging a log line)."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from swarm.bus.subscriptions import Subscription, Subscriptions
from swarm.bus.topics import Topics
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
