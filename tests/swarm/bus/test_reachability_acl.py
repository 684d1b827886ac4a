"""A peer's reachability report (`peers/{peer}/reachability`), against real brokers (the embedded
amqtt one and Mosquitto with the shipped ACL): only the scheduler writes it, and a peer reads its
own, not another's, whether live or retained."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from swarm.bus.broker import EmbeddedBroker
from swarm.bus.topics import ANY, SCHEDULER_USER, Topics
from swarm.proto import control_pb2 as pb
from tests.support.brokers import Mosquitto
from tests.support.buses import WAIT_S, bus

pytestmark = pytest.mark.timeout(60)

QUIET_S = 0.5  # how long "nothing (more) arrives" is watched
TOKEN = "s3cret"
SCHEDULER_TOKEN = "sched-only"
TOPICS = Topics()


@contextlib.asynccontextmanager
async def _broker(kind: str, tmp_path: Path) -> AsyncIterator[str]:
    if kind == "amqtt":
        async with EmbeddedBroker(token=TOKEN, scheduler_token=SCHEDULER_TOKEN) as embedded:
            yield embedded.url
    else:
        users = {SCHEDULER_USER: SCHEDULER_TOKEN, "a": TOKEN, "b": TOKEN}
        mosquitto = Mosquitto(tmp_path, acl=True, users=users)
        await asyncio.to_thread(mosquitto.start)
        try:
            yield mosquitto.url
        finally:
            await asyncio.to_thread(mosquitto.stop)


def _report(peer: str, detail: str) -> pb.ReachabilityReport:
    return pb.ReachabilityReport(
        peer=peer, reachability=pb.REACHABILITY_UNREACHABLE, address=f"{peer}:1", detail=detail
    )


async def _topics_within(
    sub: AsyncIterator[tuple[str, object]], quiet_s: float, first: str | None = None
) -> list[str]:
    """The topics `sub` delivers until it is quiet for `quiet_s`; `first`: one awaited for up to
    `WAIT_S` before that (it is the first of them)."""
    seen = []
    if first is not None:
        async with asyncio.timeout(WAIT_S):
            seen.append((await anext(sub))[0])
    with contextlib.suppress(TimeoutError):
        while True:
            async with asyncio.timeout(quiet_s):
                topic, _ = await anext(sub)
            seen.append(topic)
    return seen


@pytest.mark.attack("42.1")
@pytest.mark.parametrize("kind", ["amqtt", "mosquitto"])
async def test_a_peer_reads_its_own_reachability_report_only_and_cannot_write_one(
    kind: str, tmp_path: Path
) -> None:
    async with (
        _broker(kind, tmp_path) as url,
        bus(url, "scheduler", token=SCHEDULER_TOKEN, username=SCHEDULER_USER) as scheduler,
        bus(url, "peer-a", token=TOKEN, username="a") as a,
    ):
        await scheduler.wait_connected(WAIT_S)
        await a.wait_connected(WAIT_S)
        for peer in ("a", "b"):  # retained before a subscribes
            await scheduler.publish(TOPICS.reachability(peer), _report(peer, "old"), retain=True)
        reports = a.subscribe(TOPICS.reachability(ANY))
        await reports.wait_subscribed(WAIT_S)
        mine = TOPICS.reachability("a")
        assert await _topics_within(reports, QUIET_S, mine) == [mine]
        for peer in ("b", "a"):  # live
            await scheduler.publish(TOPICS.reachability(peer), _report(peer, "new"), retain=True)
        assert await _topics_within(reports, QUIET_S, mine) == [mine]

        # A peer cannot vouch for itself (nor for another): its report is dropped.
        watched = scheduler.subscribe(TOPICS.reachability(ANY))
        await watched.wait_subscribed(WAIT_S)
        await _topics_within(watched, QUIET_S)  # the retained ones
        forged = pb.ReachabilityReport(peer="a", reachability=pb.REACHABILITY_DIRECT)
        await a.publish(TOPICS.reachability("a"), forged, retain=True)
        await a.publish(TOPICS.reachability("b"), forged, retain=True)
        await scheduler.publish(TOPICS.reachability("b"), _report("b", "marker"))
        async with asyncio.timeout(WAIT_S):
            topic, message = await anext(watched)
        assert topic == TOPICS.reachability("b") and isinstance(message, pb.ReachabilityReport)
        assert message.detail == "marker"  # the marker came, nothing of a's before it
        assert await _topics_within(watched, QUIET_S) == []
