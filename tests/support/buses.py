"""Bus clients for tests against a real broker: `bus` with the tests' settings and a registry of
its own, bounded receives, and the logins a broker written for the swarm must let in (and those
it must refuse)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf.message import Message
from prometheus_client import CollectorRegistry

from swarm.bus.connection import Bus, BusAuthError, BusSettings, Subscription
from swarm.bus.topics import ANY, SCHEDULER_USER, Topics
from swarm.deadline import within
from swarm.proto import control_pb2 as pb

__all__ = ["FAST", "WAIT_S", "bus", "check_logins", "login", "receive", "receive_until"]

WAIT_S = 10.0  # bound on any single expected event
FAST = BusSettings(keepalive_s=2, operation_timeout_s=3.0, close_timeout_s=4.0)
TOPICS = Topics()


def bus(url: str, client_id: str, **kwargs: Any) -> Bus:
    """A bus to `url` with `FAST` settings and a fresh registry, unless `kwargs` say otherwise."""
    kwargs.setdefault("registry", CollectorRegistry())
    kwargs.setdefault("settings", FAST)
    return Bus(url, client_id, **kwargs)


def login(url: str, user: str, password: str, client_id: str | None = None) -> Bus:
    """A bus logging in as `user` with `password`."""
    return bus(url, client_id or f"test-{user}", token=password, username=user)


async def receive(sub: Subscription, timeout: float = WAIT_S) -> tuple[str, Message]:
    return await within(anext(sub), timeout)


async def receive_until(
    sub: Subscription, done: Callable[[str, Message], bool], timeout: float = WAIT_S
) -> tuple[str, Message]:
    """The first message for which `done` holds, skipping others; bounded by `timeout`."""
    async with asyncio.timeout(timeout):
        async for topic, message in sub:
            if done(topic, message):
                return topic, message
    raise AssertionError("subscription ended")


async def check_logins(url: str, peer: str, token: str, scheduler_token: str) -> None:
    """On the broker at `url`: the scheduler logs in with its own password and sees `peer`,
    logged in with `token`, publish its announcement; `peer` cannot publish another's, and
    neither a stranger nor the token as the scheduler gets in."""
    async with (
        login(url, SCHEDULER_USER, scheduler_token) as scheduler,
        login(url, peer, token) as p,
    ):
        await scheduler.wait_connected(WAIT_S)
        seen = scheduler.subscribe(TOPICS.peer(ANY))
        await seen.wait_subscribed(WAIT_S)
        await p.wait_connected(WAIT_S)
        # In order on one connection: if the second arrives first, the first was dropped.
        await p.publish(TOPICS.peer("someone-else"), pb.PeerAnnouncement(address="x:1"))
        await p.publish(TOPICS.peer(peer), pb.PeerAnnouncement(address="a:1"), retain=True)
        async with asyncio.timeout(WAIT_S):
            assert (await anext(seen))[0] == TOPICS.peer(peer)
    for user, password in (("stranger", token), (SCHEDULER_USER, token), (peer, "wrong")):
        async with login(url, user, password) as refused:
            with pytest.raises(BusAuthError):
                await refused.wait_connected(WAIT_S)
