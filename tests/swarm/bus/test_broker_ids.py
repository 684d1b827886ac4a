"""Whose client ids the embedded broker keeps, with raw MQTT CONNECTs: `peer-X` is user X's and
`scheduler` the scheduler's, connected or not, so that nobody else can hold one while its owner is
away (the owner was then refused, and retried forever) nor unseat its owner while connected."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from swarm.bus.broker import EmbeddedBroker
from swarm.bus.connection import BusAuthError
from swarm.bus.topics import ANY, SCHEDULER_USER, Topics
from swarm.net import tls
from swarm.proto import control_pb2 as pb
from tests.support.buses import WAIT_S, bus, receive
from tests.support.raw_mqtt import RawClient, connect_packet
from tests.support.tls import become, named_ca

pytestmark = pytest.mark.timeout(60)

QUIET_S = 0.5  # how long "nothing happens" is watched
TOKEN = "s3cret"  # the swarm's: every peer holds it
SCHEDULER_TOKEN = "sched-only"  # the scheduler's own
TOPICS = Topics()


def _serving(peer: str) -> pb.PeerAnnouncement:
    return pb.PeerAnnouncement(peer=peer, address=f"{peer}:1", state=pb.PEER_STATE_SERVING)


@pytest.mark.attack("N8")
async def test_an_absent_peers_client_id_is_not_for_another_user() -> None:
    """User y under peer x's client id while x is away: refused, so x then gets in (y's
    squatting session made the broker refuse x, code 2 (paho: 133), on every retry)."""
    async with (
        EmbeddedBroker(token=TOKEN, scheduler_token=SCHEDULER_TOKEN) as broker,
        await RawClient.open("127.0.0.1", broker.port) as squatter,
    ):
        await squatter.send(connect_packet("peer-x", username="y", password=TOKEN))
        assert await squatter.connack(WAIT_S) not in (0, None), "y holds peer-x"
        async with await RawClient.open("127.0.0.1", broker.port) as x:
            await x.send(connect_packet("peer-x", username="x", password=TOKEN))
            assert await x.connack(WAIT_S) == 0
            assert not await x.closed_by_broker(QUIET_S)


@pytest.mark.attack("N8")
async def test_another_user_under_a_connected_peers_id_neither_gets_in_nor_kicks_it() -> None:
    async with (
        EmbeddedBroker(token=TOKEN, scheduler_token=SCHEDULER_TOKEN) as broker,
        await RawClient.open("127.0.0.1", broker.port) as x,
        await RawClient.open("127.0.0.1", broker.port) as thief,
    ):
        await x.send(connect_packet("peer-x", username="x", password=TOKEN))
        assert await x.connack(WAIT_S) == 0
        await thief.send(connect_packet("peer-x", username="y", password=TOKEN))
        assert await thief.connack(WAIT_S) not in (0, None)
        assert not await x.closed_by_broker(QUIET_S)


@pytest.fixture
def pki(tmp_path: Path) -> Iterator[Path]:
    """A swarm CA with certificates named broker, x and y; no identity is left behind."""
    yield named_ca(tmp_path, "broker", "x", "y")
    tls.configure(None)


@pytest.mark.attack("N8")
async def test_under_certificate_users_a_peers_id_is_its_certificates(pki: Path) -> None:
    """With --use-identity-as-username the binding is real: the holder of certificate y, which
    says it is user x, is user y, and is refused peer x's client id; x's certificate gets it."""
    become(pki, "broker")
    async with EmbeddedBroker(token=TOKEN, use_identity_as_username=True) as broker:
        become(pki, "y")
        liar = bus(broker.url, "peer-x", token=TOKEN, username="x")
        with pytest.raises(BusAuthError):
            async with liar:
                await liar.wait_connected(WAIT_S)
        become(pki, "x")
        async with bus(broker.url, "peer-x", token=TOKEN, username="x") as x:
            await x.wait_connected(WAIT_S)


@pytest.mark.attack("N2")
@pytest.mark.parametrize(
    "login",
    [
        {"username": "a", "password": TOKEN},  # a peer's right login
        {"username": SCHEDULER_USER, "password": TOKEN},  # the swarm token is not the scheduler's
        {},  # no login at all
    ],
    ids=["peer", "swarm-token", "anonymous"],
)
async def test_the_schedulers_client_id_without_its_credential_is_refused(
    login: dict[str, Any],
) -> None:
    """And the scheduler's session survives it: it still hears a peer's announcement."""
    async with (
        EmbeddedBroker(token=TOKEN, scheduler_token=SCHEDULER_TOKEN) as broker,
        bus(broker.url, "scheduler", token=SCHEDULER_TOKEN, username=SCHEDULER_USER) as sched,
        bus(broker.url, "peer-a", token=TOKEN, username="a") as a,
    ):
        await sched.wait_connected(WAIT_S)
        await a.wait_connected(WAIT_S)
        peers = sched.subscribe(TOPICS.peer(ANY))
        await peers.wait_subscribed(WAIT_S)
        async with await RawClient.open("127.0.0.1", broker.port) as thief:
            await thief.send(connect_packet("scheduler", **login))
            assert await thief.connack(WAIT_S) not in (0, None)
        await a.publish(TOPICS.peer("a"), _serving("a"))
        assert (await receive(peers))[0] == TOPICS.peer("a")
        assert sched.connected


@pytest.fixture
def invited(tmp_path: Path) -> Iterator[Path]:
    """A swarm CA with the broker's certificate and an invite's for alice (CN alice, the peer
    ids alice and LABEL.alice); no identity is left behind."""
    from swarm.net import invite

    pki = named_ca(tmp_path, "broker")
    made = invite.make("alice", "mqtts://127.0.0.1:8883", "x:1", ca_dir=pki, hosts=[], token=TOKEN)
    files = invite.unpack(made, tmp_path / "alice")
    assert files.cert and files.key
    (pki / "alice.pem").write_bytes(files.cert.read_bytes())
    (pki / "alice.key").write_bytes(files.key.read_bytes())
    yield pki
    tls.configure(None)


@pytest.mark.attack("64.8")
async def test_under_certificate_users_an_invites_second_id_is_its_own(invited: Path) -> None:
    """One rule, every check (issue 68 item 1): under --use-identity-as-username the user is the
    certificate's name, `alice`; before, a second machine on alice's invite (`--peer gpu1.alice`)
    was refused its client id (`peer-gpu1.alice` is user gpu1.alice's) and its topics. Now what
    the invite certifies is hers, at the broker as at the relay; another's id is not."""
    become(invited, "broker")
    async with EmbeddedBroker(token=TOKEN, use_identity_as_username=True) as broker:
        become(invited, "alice")
        async with (
            bus(broker.url, "peer-alice", token=TOKEN, username="alice") as first,
            bus(broker.url, "peer-gpu1.alice", token=TOKEN, username="gpu1.alice") as second,
        ):
            await first.wait_connected(WAIT_S)
            await second.wait_connected(WAIT_S)
            peers = first.subscribe(TOPICS.peer(ANY))
            await peers.wait_subscribed(WAIT_S)
            await second.publish(TOPICS.peer("bob"), _serving("bob"))  # not hers: dropped
            await second.publish(TOPICS.peer("gpu1.alice"), _serving("gpu1.alice"))
            assert (await receive(peers))[0] == TOPICS.peer("gpu1.alice")
        thief = bus(broker.url, "peer-bob", token=TOKEN, username="bob")
        with pytest.raises(BusAuthError):
            async with thief:
                await thief.wait_connected(WAIT_S)
