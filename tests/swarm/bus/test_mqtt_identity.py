"""MQTT identity, with real brokers (the embedded amqtt one, and Mosquitto with the bundled ACL):
a peer's name comes from the topic, never the payload, and a peer publishes only its own topics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from scheduler.registry import PeerRegistry
from scheduler.service import Scheduler, SchedulerOptions
from scheduler.store import JobStore
from swarm.bus.broker import EmbeddedBroker
from swarm.bus.connection import BusAuthError
from swarm.bus.topics import ANY, SCHEDULER_USER, Topics
from swarm.proto import control_pb2 as pb
from tests.support.brokers import Mosquitto
from tests.support.buses import WAIT_S
from tests.support.buses import bus as _bus

pytestmark = pytest.mark.timeout(60)

QUIET_S = 0.5  # how long "nothing arrives" is watched
TOKEN = "s3cret"  # the swarm's: every peer holds it
SCHEDULER_TOKEN = "sched-only"  # the scheduler's own


def _serving(peer: str) -> pb.PeerAnnouncement:
    return pb.PeerAnnouncement(
        peer=peer, job="j", stage=0, address=f"{peer}:1", state=pb.PEER_STATE_SERVING
    )


@contextlib.asynccontextmanager
async def _broker(kind: str, tmp_path: Path) -> AsyncIterator[str]:
    """A broker requiring the token, with the swarm's ACL; yields its URL."""
    if kind == "amqtt":
        async with EmbeddedBroker(token=TOKEN, scheduler_token=SCHEDULER_TOKEN) as embedded:
            yield embedded.url
    else:
        mosquitto = Mosquitto(
            tmp_path, acl=True, users={SCHEDULER_USER: SCHEDULER_TOKEN, "a": TOKEN}
        )
        await asyncio.to_thread(mosquitto.start)
        try:
            yield mosquitto.url
        finally:
            await asyncio.to_thread(mosquitto.stop)


async def _nothing_on(sub: AsyncIterator[tuple[str, object]]) -> None:
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(QUIET_S):
            topic, _ = await anext(sub)
            pytest.fail(f"{topic} arrived")


# ------------------------------------------------------------------- the name is the topic's


async def test_a_payload_naming_another_peer_does_not_update_it(tmp_path: Path) -> None:
    """On peers/A, a payload claiming to be B: the scheduler's registry has no B, and its load
    report on peers/A/load claiming B changes nothing of B (an open broker: no ACL to help)."""
    async with EmbeddedBroker() as broker:
        with JobStore(tmp_path / "jobs.sqlite") as store:
            async with _bus(broker.url, "scheduler") as bus, _bus(broker.url, "peer-a") as peer:
                scheduler = Scheduler(store, bus, SchedulerOptions(tmp_path / "ckpt"))
                registry: PeerRegistry = scheduler.peer_registry
                await bus.wait_connected(WAIT_S)
                await peer.wait_connected(WAIT_S)
                watchers = [
                    asyncio.create_task(scheduler._watch_peers()),
                    asyncio.create_task(scheduler._watch_load()),
                ]
                try:
                    await peer.publish(peer.topics.peer("b"), _serving("b"), retain=True)
                    async with asyncio.timeout(WAIT_S):
                        while "b" not in registry.peers:
                            await asyncio.sleep(0.02)
                    # A now claims to be B, twice: its announcement and its load report
                    liar = _serving("b")
                    liar.address = "evil:1"
                    await peer.publish(peer.topics.peer("a"), liar, retain=True)
                    report = pb.LoadReport(peer="b", job="j", stage=0, ema_seconds_per_sample=9.0)
                    await peer.publish(peer.topics.load("a"), report)
                    marker = _serving("c")
                    await peer.publish(peer.topics.peer("c"), marker, retain=True)
                    async with asyncio.timeout(WAIT_S):  # everything before it was handled
                        while "c" not in registry.peers:
                            await asyncio.sleep(0.02)
                    assert registry.peers["b"].address == "b:1"
                    assert "b" not in registry._loads
                    assert registry.peers.get("a") is None or registry.peers["a"].peer == "a"
                finally:
                    for task in watchers:
                        task.cancel()
                    await asyncio.gather(*watchers, return_exceptions=True)


async def test_every_subscriber_gets_the_topics_name(tmp_path: Path) -> None:
    """What the bus delivers names the topic's peer (and job, where the topic has one: a load
    report's job is its payload's), whatever the payload left out."""
    async with (
        EmbeddedBroker() as broker,
        _bus(broker.url, "reader") as reader,
        _bus(broker.url, "writer") as writer,
    ):
        await reader.wait_connected(WAIT_S)
        await writer.wait_connected(WAIT_S)
        peers = reader.subscribe(reader.topics.peer(ANY))
        loads = reader.subscribe(reader.topics.load(ANY))
        await peers.wait_subscribed(WAIT_S)
        await loads.wait_subscribed(WAIT_S)
        nameless = pb.PeerAnnouncement(address="a:1")  # not empty: b"" clears a topic
        await writer.publish(writer.topics.peer("a"), nameless, retain=True)
        await writer.publish(writer.topics.load("a"), pb.LoadReport(job="j", queue_depth=1))
        async with asyncio.timeout(WAIT_S):
            _, announced = await anext(peers)
            _, loaded = await anext(loads)
        assert isinstance(announced, pb.PeerAnnouncement) and announced.peer == "a"
        assert isinstance(loaded, pb.LoadReport) and (loaded.peer, loaded.job) == ("a", "j")


# ---------------------------------------------------------------------------- the brokers' ACL


@pytest.mark.parametrize("kind", ["amqtt", "mosquitto"])
async def test_a_peer_publishes_only_its_own_topics(kind: str, tmp_path: Path) -> None:
    topics = Topics()
    async with _broker(kind, tmp_path) as url:
        async with (
            _bus(url, "scheduler", token=SCHEDULER_TOKEN, username=SCHEDULER_USER) as watcher,
            _bus(url, "peer-a", token=TOKEN, username="a") as a,
        ):
            await watcher.wait_connected(WAIT_S)
            await a.wait_connected(WAIT_S)
            everything = watcher.subscribe(topics.everything())
            await everything.wait_subscribed(WAIT_S)
            # another peer's announcement and load, and the scheduler's topics: dropped
            await a.publish(topics.peer("b"), _serving("b"), retain=True)
            await a.publish(topics.load("b"), pb.LoadReport(peer="b"))
            await a.publish(topics.assign("j", "a"), pb.Assignment(job="j", peer="a", stage=1))
            await a.publish(topics.job("j"), pb.JobAnnouncement(job="j"), retain=True)
            await _nothing_on(everything)
            # its own: delivered
            await a.publish(topics.peer("a"), _serving("a"), retain=True)
            await a.publish(topics.load("a"), pb.LoadReport(peer="a", queue_depth=2))
            async with asyncio.timeout(WAIT_S):
                got = {(await anext(everything))[0] for _ in range(2)}
            assert got == {topics.peer("a"), topics.load("a")}
            # and the scheduler publishes everything
            await watcher.publish(topics.job("j"), pb.JobAnnouncement(job="j"), retain=True)
            async with asyncio.timeout(WAIT_S):
                assert (await anext(everything))[0] == topics.job("j")
        # nothing of B was retained either
        async with _bus(url, "late", token=SCHEDULER_TOKEN, username=SCHEDULER_USER) as late:
            await late.wait_connected(WAIT_S)
            sub = late.subscribe(topics.peer(ANY))
            async with asyncio.timeout(WAIT_S):
                topic, _ = await anext(sub)
            assert topic == topics.peer("a")
            await _nothing_on(sub)


@pytest.mark.parametrize("kind", ["amqtt", "mosquitto"])
async def test_a_last_will_on_another_peers_topic_is_refused(kind: str, tmp_path: Path) -> None:
    """A peer cannot make another look offline by its last-will: the broker refuses the will
    (amqtt: the connection; Mosquitto: the will, when the connection ends)."""
    topics = Topics()
    offline = pb.PeerAnnouncement(peer="b", state=pb.PEER_STATE_OFFLINE)
    async with (
        _broker(kind, tmp_path) as url,
        _bus(url, "scheduler", token=SCHEDULER_TOKEN, username=SCHEDULER_USER) as watcher,
    ):
        await watcher.wait_connected(WAIT_S)
        peers = watcher.subscribe(topics.peer(ANY))
        await peers.wait_subscribed(WAIT_S)
        will = (topics.peer("b"), offline)
        async with _bus(url, "peer-a", token=TOKEN, username="a", will=will) as a:
            with contextlib.suppress(BusAuthError):
                await a.wait_connected(2.0)
        await _nothing_on(peers)
