"""Who gets past the broker's CONNECT, against real brokers (the embedded amqtt one and Mosquitto):
a refused login touches nobody's session, a client id is not for taking, and a last-will passes
the ACL when it is sent, not only when it is registered."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from swarm.bus.broker import EmbeddedBroker
from swarm.bus.connection import Bus
from swarm.bus.topics import ANY, SCHEDULER_USER, Topics, parse_broker_url
from swarm.net.peer_ids import MAX_PEER_ID_CHARS
from swarm.proto import control_pb2 as pb
from tests.support.brokers import Mosquitto
from tests.support.buses import WAIT_S, bus
from tests.support.raw_mqtt import RawClient, Will, connect_packet

pytestmark = pytest.mark.timeout(60)

QUIET_S = 0.5  # how long "nothing arrives" is watched
TOKEN = "s3cret"  # the swarm's: every peer holds it
SCHEDULER_TOKEN = "sched-only"  # the scheduler's own
TOPICS = Topics()


@dataclass
class Broker:
    kind: str
    url: str
    embedded: EmbeddedBroker | None = None

    @property
    def host_port(self) -> tuple[str, int]:
        address = parse_broker_url(self.url)
        return address.host, address.port


@contextlib.asynccontextmanager
async def _broker(kind: str, tmp_path: Path) -> AsyncIterator[Broker]:
    """A broker requiring the token, with the swarm's ACL."""
    if kind == "amqtt":
        async with EmbeddedBroker(token=TOKEN, scheduler_token=SCHEDULER_TOKEN) as embedded:
            yield Broker(kind, embedded.url, embedded)
    else:
        mosquitto = Mosquitto(
            tmp_path, acl=True, users={SCHEDULER_USER: SCHEDULER_TOKEN, "a": TOKEN}
        )
        await asyncio.to_thread(mosquitto.start)
        try:
            yield Broker(kind, mosquitto.url)
        finally:
            await asyncio.to_thread(mosquitto.stop)


def _scheduler(broker: Broker) -> Bus:
    return bus(broker.url, "scheduler", token=SCHEDULER_TOKEN, username=SCHEDULER_USER)


def _serving(peer: str) -> pb.PeerAnnouncement:
    return pb.PeerAnnouncement(peer=peer, address=f"{peer}:1", state=pb.PEER_STATE_SERVING)


async def _hears_peer(sub: AsyncIterator[tuple[str, object]], broker: Broker) -> str:
    """Peer a announces itself; the scheduler's subscription `sub` must deliver it."""
    async with bus(broker.url, "peer-a", token=TOKEN, username="a") as a:
        await a.wait_connected(WAIT_S)
        await a.publish(TOPICS.peer("a"), _serving("a"))
        async with asyncio.timeout(WAIT_S):
            topic, _ = await anext(sub)
    return topic


# ------------------------------------------------------------- a refused login touches nothing


@pytest.mark.parametrize("kind", ["amqtt", "mosquitto"])
async def test_a_wrong_password_under_the_schedulers_client_id_leaves_it_subscribed(
    kind: str, tmp_path: Path
) -> None:
    """amqtt 0.12.1 deleted the session (and subscriptions) of a clean-session CONNECT's client
    id before it checked the password: the scheduler, still connected, stopped hearing peers."""
    async with _broker(kind, tmp_path) as broker, _scheduler(broker) as scheduler:
        await scheduler.wait_connected(WAIT_S)
        peers = scheduler.subscribe(TOPICS.peer(ANY))
        await peers.wait_subscribed(WAIT_S)
        async with await RawClient.open(*broker.host_port) as thief:
            await thief.send(connect_packet("scheduler", username=SCHEDULER_USER, password="x"))
            assert await thief.connack(WAIT_S) not in (0, None)  # refused, and said so
        assert await _hears_peer(peers, broker) == TOPICS.peer("a")


@pytest.mark.parametrize("kind", ["amqtt", "mosquitto"])
async def test_a_wrong_password_with_a_persistent_session_neither_kicks_nor_wills(
    kind: str, tmp_path: Path
) -> None:
    """amqtt 0.12.1, on a clean_session=0 CONNECT for a connected client id, copied the CONNECT's
    last-will into the victim's session and kicked the victim before it checked the password:
    the victim's disconnect then sent the thief's will, past the ACL, retained as the victim's."""
    forged = pb.Assignment(job="j", peer="a", stage=1)
    will = Will(TOPICS.assign("j", "a"), forged.SerializeToString(), retain=True)
    async with _broker(kind, tmp_path) as broker, _scheduler(broker) as scheduler:
        offline = pb.PeerAnnouncement(peer="a", state=pb.PEER_STATE_OFFLINE)
        own_will = (TOPICS.peer("a"), offline)
        async with bus(broker.url, "peer-a", token=TOKEN, username="a", will=own_will) as victim:
            await scheduler.wait_connected(WAIT_S)
            await victim.wait_connected(WAIT_S)
            everything = scheduler.subscribe(TOPICS.everything())
            await everything.wait_subscribed(WAIT_S)
            async with await RawClient.open(*broker.host_port) as thief:
                login = connect_packet("peer-a", username="a", password="x", clean=False, will=will)
                await thief.send(login)
                assert await thief.connack(WAIT_S) not in (0, None)
            await victim.publish(TOPICS.load("a"), pb.LoadReport(queue_depth=1))
            async with asyncio.timeout(WAIT_S):  # the marker; nothing came before it
                topic, _ = await anext(everything)
            assert topic == TOPICS.load("a")
            with pytest.raises(TimeoutError):  # nor after: no will, no reconnect of the victim
                async with asyncio.timeout(QUIET_S):
                    topic, _ = await anext(everything)
                    pytest.fail(f"{topic} arrived")
        async with bus(broker.url, "late", token=SCHEDULER_TOKEN, username=SCHEDULER_USER) as late:
            await late.wait_connected(WAIT_S)
            retained = late.subscribe(TOPICS.assign(ANY, ANY))
            await retained.wait_subscribed(WAIT_S)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(QUIET_S):
                    topic, _ = await anext(retained)
                    pytest.fail(f"{topic} was retained")


# --------------------------------------------------------------- the embedded broker's own rules


async def test_the_embedded_broker_refuses_a_persistent_session(tmp_path: Path) -> None:
    """The swarm's clients always start clean; a persistent session is refused, right login or
    not (it is how a CONNECT reached another connection's session)."""
    async with (
        _broker("amqtt", tmp_path) as broker,
        await RawClient.open(*broker.host_port) as client,
    ):
        await client.send(connect_packet("peer-x", username="x", password=TOKEN, clean=False))
        assert await client.connack(WAIT_S) not in (0, None)


async def test_the_embedded_broker_refuses_a_user_named_past_a_peer_ids_bound(
    tmp_path: Path,
) -> None:
    """A peer's user is its peer id, its topics' level: one of 60,000 characters retained an
    announcement of 100 bytes on a topic of 60 kB, which its budget did not count, and every
    reader kept the id. Refused at its CONNECT, as is one with a control character; one at the
    bound gets in."""
    async with _broker("amqtt", tmp_path) as broker:
        async with await RawClient.open(*broker.host_port) as long:
            user = "p" * 60_000
            await long.send(connect_packet("c-long", username=user, password=TOKEN))
            assert await long.connack(WAIT_S) not in (0, None)
        async with await RawClient.open(*broker.host_port) as forging:
            user = "a\nERROR scheduler: forged"  # said in log lines as it is
            await forging.send(connect_packet("c-forging", username=user, password=TOKEN))
            assert await forging.connack(WAIT_S) not in (0, None)
        async with await RawClient.open(*broker.host_port) as bounded:
            user = "p" * MAX_PEER_ID_CHARS
            await bounded.send(connect_packet("c-bounded", username=user, password=TOKEN))
            assert await bounded.connack(WAIT_S) == 0


async def test_a_peer_cannot_take_the_schedulers_client_id(tmp_path: Path) -> None:
    """A peer with the right login, under the connected scheduler's client id: refused, and the
    scheduler keeps its session (amqtt 0.12.1 dropped its subscriptions and kept it connected)."""
    async with _broker("amqtt", tmp_path) as broker, _scheduler(broker) as scheduler:
        await scheduler.wait_connected(WAIT_S)
        peers = scheduler.subscribe(TOPICS.peer(ANY))
        await peers.wait_subscribed(WAIT_S)
        async with await RawClient.open(*broker.host_port) as peer:
            await peer.send(connect_packet("scheduler", username="a", password=TOKEN))
            assert await peer.connack(WAIT_S) not in (0, None)
        assert await _hears_peer(peers, broker) == TOPICS.peer("a")


async def test_no_peer_holds_the_schedulers_client_id_before_it_connects(tmp_path: Path) -> None:
    """The scheduler's client id is the scheduler's alone: a peer with the right login that
    takes it first (the scheduler restarting, say) is refused, and the scheduler gets in (it
    was locked out: amqtt refused its CONNECT with code 2 while the squatter stayed)."""
    async with (
        _broker("amqtt", tmp_path) as broker,
        await RawClient.open(*broker.host_port) as squatter,
    ):
        await squatter.send(connect_packet("scheduler", username="a", password=TOKEN))
        assert await squatter.connack(WAIT_S) not in (0, None)
        async with _scheduler(broker) as scheduler:
            await scheduler.wait_connected(WAIT_S)


async def test_a_last_will_is_checked_again_when_it_is_sent(tmp_path: Path) -> None:
    """The will passes the ACL when the connection ends, not only at CONNECT: here its topic is
    changed inside the broker after the CONNECT was let in (what a takeover once did), then the
    connection drops without a DISCONNECT; the will on another's topic is not sent."""
    async with _broker("amqtt", tmp_path) as broker, _scheduler(broker) as scheduler:
        assert broker.embedded is not None and broker.embedded._broker is not None
        await scheduler.wait_connected(WAIT_S)
        everything = scheduler.subscribe(TOPICS.everything())
        await everything.wait_subscribed(WAIT_S)
        own = Will(TOPICS.peer("a"), _serving("a").SerializeToString())
        async with await RawClient.open(*broker.host_port) as a:  # the control: it is sent
            await a.send(connect_packet("peer-a", username="a", password=TOKEN, will=own))
            assert await a.connack(WAIT_S) == 0
        async with asyncio.timeout(WAIT_S):
            assert (await anext(everything))[0] == TOPICS.peer("a")
        async with await RawClient.open(*broker.host_port) as a:
            await a.send(connect_packet("peer-a", username="a", password=TOKEN, will=own))
            assert await a.connack(WAIT_S) == 0
            session, _ = broker.embedded._broker.sessions["peer-a"]
            session.will_topic = TOPICS.assign("j", "a")
            session.will_message = pb.Assignment(job="j", peer="a", stage=1).SerializeToString()
        # the connection ended without DISCONNECT: a will is due, and refused
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(QUIET_S * 2):
                topic, _ = await anext(everything)
                pytest.fail(f"{topic} arrived")


async def test_the_same_user_again_under_its_client_id_replaces_the_old_connection(
    tmp_path: Path,
) -> None:
    """A reconnect that finds its old connection still up (the broker has not seen it die)
    closes it, as MQTT says: left open, it would hold no subscriptions and send a stale will."""
    async with (
        _broker("amqtt", tmp_path) as broker,
        await RawClient.open(*broker.host_port) as old,
        await RawClient.open(*broker.host_port) as new,
    ):
        await old.send(connect_packet("peer-a", username="a", password=TOKEN))
        assert await old.connack(WAIT_S) == 0
        await new.send(connect_packet("peer-a", username="a", password=TOKEN))
        assert await new.connack(WAIT_S) == 0
        assert await old.closed_by_broker(WAIT_S)
        assert not await new.closed_by_broker(QUIET_S)
