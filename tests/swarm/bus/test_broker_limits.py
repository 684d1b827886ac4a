"""The embedded broker's limits with real sockets: a connection that never sends its CONNECT is
closed, connections past the cap are closed while the clients already there carry on, and an
oversized packet ends its own connection only."""

from __future__ import annotations

import asyncio

import pytest

from swarm.bus.acl_broker import AclBroker
from swarm.bus.broker import EmbeddedBroker
from swarm.bus.connection import Bus
from swarm.bus.limits import BrokerLimits
from swarm.bus.topics import ANY, Topics
from swarm.errors import ConfigError
from swarm.proto import control_pb2 as pb
from tests.support.buses import WAIT_S, bus
from tests.support.raw_mqtt import RawClient, connect_packet, packet, publish_packet

pytestmark = pytest.mark.timeout(60)

QUIET_S = 0.5  # how long "nothing happens" is watched
TOPICS = Topics()


def _serving(peer: str) -> pb.PeerAnnouncement:
    return pb.PeerAnnouncement(peer=peer, address=f"{peer}:1", state=pb.PEER_STATE_SERVING)


async def _delivers(sender: Bus, sub: object, peer: str) -> None:
    """`sender` publishes peer's announcement and `sub` gets it: the clients still work."""
    await sender.publish(TOPICS.peer(peer), _serving(peer))
    async with asyncio.timeout(WAIT_S):
        topic, _ = await anext(sub)  # type: ignore[call-overload]
    assert topic == TOPICS.peer(peer)


def test_limits_are_checked() -> None:
    with pytest.raises(ConfigError, match="connect_timeout_s"):
        BrokerLimits(connect_timeout_s=0)
    with pytest.raises(ConfigError, match="max_connections"):
        BrokerLimits(max_connections=0)
    assert BrokerLimits().max_connections >= 16


async def test_a_socket_that_never_sends_connect_is_closed() -> None:
    limits = BrokerLimits(connect_timeout_s=1.5)  # room for a CONNECT on a busy machine
    async with EmbeddedBroker(limits=limits) as broker:
        async with await RawClient.open("127.0.0.1", broker.port) as idle:
            assert await idle.closed_by_broker(WAIT_S)
        # a CONNECT in time is let in, and kept past the timeout
        async with await RawClient.open("127.0.0.1", broker.port) as client:
            await client.send(connect_packet("c1", keepalive=0))
            assert await client.connack(WAIT_S) == 0
            assert not await client.closed_by_broker(2.0)


async def test_a_session_amqtt_ends_without_closing_is_closed_on_the_brokers_side(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """amqtt returns from some sessions (a client gone mid-session, as a SIGKILLed aggregator's)
    without closing its side of the connection: the broker closes it when the session ends, so
    no socket is left to the garbage collector (which warned in whatever test ran then)."""

    async def returns_open(self: AclBroker, listener: str, reader: object, writer: object) -> None:
        return None  # what amqtt's session does on that path: nothing closed

    async with EmbeddedBroker() as broker:
        monkeypatch.setattr(AclBroker, "_client_connected", returns_open)
        async with await RawClient.open("127.0.0.1", broker.port) as client:
            await client.send(connect_packet("c1", keepalive=0))
            assert await client.closed_by_broker(WAIT_S)


async def test_a_silent_connection_is_closed_during_the_tls_handshake_too(
    tls_identity: None,
) -> None:
    """Under TLS the silence may come before the handshake ends: bounded the same."""
    limits = BrokerLimits(connect_timeout_s=0.3)
    async with EmbeddedBroker(limits=limits) as broker:
        assert broker.scheme == "mqtts"
        async with await RawClient.open("127.0.0.1", broker.port) as idle:  # no ClientHello
            assert await idle.closed_by_broker(WAIT_S)


async def test_connections_past_the_cap_are_closed_and_the_others_carry_on() -> None:
    limits = BrokerLimits(max_connections=3, connect_timeout_s=30.0)
    async with (
        EmbeddedBroker(limits=limits) as broker,
        bus(broker.url, "reader") as reader,
        bus(broker.url, "writer") as writer,
    ):
        await reader.wait_connected(WAIT_S)
        await writer.wait_connected(WAIT_S)
        peers = reader.subscribe(TOPICS.peer(ANY))
        await peers.wait_subscribed(WAIT_S)
        async with await RawClient.open("127.0.0.1", broker.port) as third:
            await third.send(connect_packet("third"))
            assert await third.connack(WAIT_S) == 0  # three held
            async with await RawClient.open("127.0.0.1", broker.port) as fourth:
                assert await fourth.closed_by_broker(WAIT_S)  # at once, not at the timeout
            assert not await third.closed_by_broker(QUIET_S)
            await _delivers(writer, peers, "a")
        # a slot is free again, once the broker has seen the third one go
        async with asyncio.timeout(WAIT_S):
            while True:
                async with await RawClient.open("127.0.0.1", broker.port) as again:
                    await again.send(connect_packet("again"))
                    if await again.connack(WAIT_S) == 0:
                        break
                await asyncio.sleep(0.02)


async def test_an_oversized_packet_drops_its_connection_only() -> None:
    limits = BrokerLimits(max_packet_bytes=4096)
    async with (
        EmbeddedBroker(limits=limits) as broker,
        bus(broker.url, "reader") as reader,
        bus(broker.url, "writer") as writer,
    ):
        await reader.wait_connected(WAIT_S)
        await writer.wait_connected(WAIT_S)
        everything = reader.subscribe(TOPICS.everything())
        await everything.wait_subscribed(WAIT_S)
        async with await RawClient.open("127.0.0.1", broker.port) as big:
            await big.send(connect_packet("big"))
            assert await big.connack(WAIT_S) == 0
            await big.send(publish_packet(TOPICS.peer("big"), b"x" * 4097))
            assert await big.closed_by_broker(WAIT_S)
        # only announced, never sent: refused on its header, nothing buffered
        async with await RawClient.open("127.0.0.1", broker.port) as liar:
            await liar.send(connect_packet("liar"))
            assert await liar.connack(WAIT_S) == 0
            await liar.send(bytes([0x30, 0xFF, 0xFF, 0xFF, 0x7F]))  # 256 MiB to follow
            assert await liar.closed_by_broker(WAIT_S)
        async with await RawClient.open("127.0.0.1", broker.port) as huge_connect:
            await huge_connect.send(packet(0x10, b"\x00" * 5000))
            assert await huge_connect.closed_by_broker(WAIT_S)
        # nothing of theirs was delivered; a packet of the cap exactly is, and the others carry on
        # (a job's announcement: a peer's message this long is past its own bounds, dropped
        # by the reader's dispatch, `swarm.bus.bounds`)
        edge = TOPICS.job("edge")
        payload = b""
        for k in range(4096):
            payload = pb.JobAnnouncement(spec="x" * k).SerializeToString()
            if 2 + len(edge) + len(payload) == 4096:
                break
        async with await RawClient.open("127.0.0.1", broker.port) as exact:
            await exact.send(connect_packet("exact"))
            assert await exact.connack(WAIT_S) == 0
            await exact.send(publish_packet(edge, payload))
            async with asyncio.timeout(WAIT_S):
                assert (await anext(everything))[0] == edge
        await writer.publish(TOPICS.peer("a"), _serving("a"))
        async with asyncio.timeout(WAIT_S):
            assert (await anext(everything))[0] == TOPICS.peer("a")
        assert reader.connected and writer.connected
