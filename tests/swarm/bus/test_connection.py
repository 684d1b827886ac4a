"""The MQTT bus against real brokers: the embedded amqtt one and Mosquitto, in turn."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from google.protobuf.message import Message
from prometheus_client import CollectorRegistry

from swarm.bus.broker import EmbeddedBroker
from swarm.bus.connection import BusAuthError, BusNotConnected, BusSettings
from swarm.bus.topics import ANY, SCHEDULER_USER, TopicInfo, TopicKind
from swarm.errors import ConfigError
from swarm.proto import control_pb2 as pb
from tests.support.brokers import BrokerUnderTest
from tests.support.buses import WAIT_S, bus, receive, receive_until
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


def serving(peer: str, stage: int = 0) -> pb.PeerAnnouncement:
    return pb.PeerAnnouncement(
        peer=peer,
        address="127.0.0.1:5000",
        device="cpu",
        job="j1",
        stage=stage,
        state=pb.PEER_STATE_SERVING,
    )


_OUR_FILES = (os.path.join("swarm", "bus.py"), os.path.join("aiomqtt", "client.py"))


def _leftover_tasks() -> list[asyncio.Task[Any]]:
    def ours(task: asyncio.Task[Any]) -> bool:
        code = getattr(task.get_coro(), "cr_code", None)
        name = code.co_filename if code else ""
        return name.endswith(_OUR_FILES)

    return [t for t in asyncio.all_tasks() if not t.done() and ours(t)]


# ------------------------------------------------------------------------------ without a broker


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError):
        BusSettings(reconnect_initial_s=10, reconnect_max_s=5)


# ------------------------------------------------------------------------------- against brokers


async def test_retained_state_reaches_late_subscriber(broker: BrokerUnderTest) -> None:
    async with bus(broker.url, "peer-a") as a:
        await a.wait_connected(WAIT_S)
        await a.publish(a.topics.peer("a"), serving("a"), retain=True)
        await a.publish(a.topics.steps("j1"), pb.StepCommitted(job="j1", step=3), retain=True)
        await a.publish(a.topics.peer("gone"), serving("gone"), retain=True)
        await a.publish(a.topics.peer("gone"), b"", retain=True)  # clears the topic

        async with bus(broker.url, "late") as late, late.subscribe(late.topics.everything()) as sub:
            seen: dict[str, Message] = {}
            while len(seen) < 2:
                topic, message = await receive(sub)
                seen[topic] = message
        assert set(seen) == {a.topics.peer("a"), a.topics.steps("j1")}
        peer = seen[a.topics.peer("a")]
        assert isinstance(peer, pb.PeerAnnouncement)
        assert peer.state == pb.PEER_STATE_SERVING and peer.HasField("stage")
        assert isinstance(seen[a.topics.steps("j1")], pb.StepCommitted)
    assert _leftover_tasks() == []


async def test_load_reaches_live_subscribers(broker: BrokerUnderTest) -> None:
    async with bus(broker.url, "sched") as sched, bus(broker.url, "peer-b") as peer:
        await sched.wait_connected(WAIT_S)
        loads = sched.subscribe(sched.topics.load(ANY))
        await loads.wait_subscribed(WAIT_S)
        await peer.publish(peer.topics.load("b"), pb.LoadReport(peer="b", queue_depth=4))
        topic, report = await receive(loads)
        assert sched.topics.parse(topic) == TopicInfo(TopicKind.LOAD, None, "b")
        assert isinstance(report, pb.LoadReport) and report.queue_depth == 4

        # A consumer cancelled mid-iteration leaves no subscription behind, and closing the bus
        # ends the iteration of the others.
        async def consume() -> None:
            async with sched.subscribe(sched.topics.peer(ANY)) as sub:
                async for _ in sub:
                    pass

        consumer = asyncio.create_task(consume())
        await wait_until(lambda: len(sched._subs) == 2, timeout_s=WAIT_S)
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        assert len(sched._subs) == 1
        draining = asyncio.create_task(receive_until(loads, lambda *_: False))
    with pytest.raises(AssertionError, match="subscription ended"):
        await draining
    assert _leftover_tasks() == []


async def test_prefix_isolates_swarms(broker: BrokerUnderTest) -> None:
    async with (
        bus(broker.url, "a", prefix="swarm-a/v1/") as a,
        bus(broker.url, "b", prefix="swarm-b/v1/") as b,
    ):
        await a.wait_connected(WAIT_S)
        await b.wait_connected(WAIT_S)
        b_all = b.subscribe(b.topics.everything())
        a_all = a.subscribe(a.topics.everything())
        await b_all.wait_subscribed(WAIT_S)
        await a_all.wait_subscribed(WAIT_S)
        await a.publish(a.topics.peer("x"), serving("x"), retain=True)
        await b.publish(b.topics.job("marker"), pb.JobAnnouncement(job="marker"))
        assert (await receive(a_all))[0] == "swarm-a/v1/peers/x"
        assert (await receive(b_all))[0] == "swarm-b/v1/jobs/marker"  # nothing from swarm-a


async def test_reconnects_and_restores_after_broker_restart(broker: BrokerUnderTest) -> None:
    async with bus(broker.url, "peer-r") as peer, bus(broker.url, "sched-r") as sched:
        await peer.wait_connected(WAIT_S)
        await sched.wait_connected(WAIT_S)
        await peer.publish(peer.topics.peer("r"), serving("r", stage=0), retain=True)
        loads = sched.subscribe(sched.topics.load(ANY))
        await loads.wait_subscribed(WAIT_S)

        await broker.stop()
        await wait_until(lambda: not peer.connected and not sched.connected, timeout_s=WAIT_S)
        # While the broker is down: a retained update is kept, a load report cannot be sent.
        await peer.publish(peer.topics.peer("r"), serving("r", stage=1), retain=True, timeout=0.2)
        with pytest.raises(BusNotConnected):
            await peer.publish(peer.topics.load("r"), pb.LoadReport(peer="r"), timeout=0.2)

        await broker.start()  # same port, empty: no retained state survived
        await peer.wait_connected(WAIT_S)
        await sched.wait_connected(WAIT_S)
        async with (
            bus(broker.url, "fresh") as fresh,
            fresh.subscribe(fresh.topics.peer(ANY)) as sub,
        ):
            _, announcement = await receive(sub)
        assert isinstance(announcement, pb.PeerAnnouncement) and announcement.stage == 1

        await loads.wait_subscribed(WAIT_S)
        await peer.publish(peer.topics.load("r"), pb.LoadReport(peer="r", in_flight=2))
        _, report = await receive(loads)
        assert isinstance(report, pb.LoadReport) and report.in_flight == 2


async def test_malformed_payload_is_dropped_and_counted(broker: BrokerUnderTest) -> None:
    registry = CollectorRegistry()
    async with (
        bus(broker.url, "reader", registry=registry) as reader,
        bus(broker.url, "writer") as writer,
    ):
        await writer.wait_connected(WAIT_S)
        everything = reader.subscribe(reader.topics.everything())
        await everything.wait_subscribed(WAIT_S)
        await writer.publish(writer.topics.peer("bad"), b"\xff\xfe\xfd not a protobuf")
        await writer.publish(writer.topics.prefix + "unknown/kind", serving("x"))
        await writer.publish(writer.topics.peer("good"), serving("good"))
        topic, message = await receive(everything)
        assert topic == writer.topics.peer("good") and isinstance(message, pb.PeerAnnouncement)
        assert registry.get_sample_value("swarm_bus_malformed_messages_total") == 2


async def test_token_guards_the_embedded_broker() -> None:
    async with EmbeddedBroker(token="s3cret", scheduler_token="sched-only") as broker:
        # the scheduler's login (its own token): the broker's ACL lets only it publish a job
        async with bus(broker.url, "good", token="sched-only", username=SCHEDULER_USER) as good:
            await good.wait_connected(WAIT_S)
            sub = good.subscribe(good.topics.job(ANY))
            await sub.wait_subscribed(WAIT_S)
            await good.publish(good.topics.job("j1"), pb.JobAnnouncement(job="j1"), retain=True)
            assert (await receive(sub))[0] == good.topics.job("j1")
        for name, token in [("wrong", "guess"), ("none", None)]:
            async with bus(broker.url, name, token=token) as bad:
                with pytest.raises(BusAuthError, match="refused"):
                    await bad.wait_connected(WAIT_S)
                with pytest.raises(BusAuthError):
                    await bad.publish(bad.topics.job("j1"), pb.JobAnnouncement(job="j1"))
    assert _leftover_tasks() == []
