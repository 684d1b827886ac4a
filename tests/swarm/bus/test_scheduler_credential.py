"""The scheduler's MQTT credential is its own: the swarm token (every peer holds it) does not log
in as the scheduler; a peer's own password (in its broker URL) is the one it sends; and under
mutual TLS the embedded broker can take the user from the client's certificate, as Mosquitto's
`use_identity_as_username` does."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from swarm.bus.broker import EmbeddedBroker
from swarm.bus.connection import BusAuthError, BusSettings
from swarm.bus.link import Dialer
from swarm.bus.topics import ANY, SCHEDULER_USER, Topics, parse_broker_url
from swarm.errors import ConfigError
from swarm.net import tls
from swarm.proto import control_pb2 as pb
from tests.support.brokers import Mosquitto
from tests.support.buses import WAIT_S, bus
from tests.support.tls import become, named_ca

pytestmark = pytest.mark.timeout(60)

QUIET_S = 0.5  # how long "nothing arrives" is watched
TOKEN = "s3cret"  # the swarm's: every peer has it
SCHEDULER_TOKEN = "sched-only"  # the scheduler's own
TOPICS = Topics()


def _with_login(url: str, user: str, password: str) -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{user}:{password}@{rest}"


@contextlib.asynccontextmanager
async def _broker(kind: str, tmp_path: Path, peers: dict[str, str]) -> AsyncIterator[str]:
    """A broker with the swarm's ACL where the scheduler's password is `SCHEDULER_TOKEN` and each
    of `peers` has its own (Mosquitto; the embedded broker knows only the swarm token)."""
    if kind == "amqtt":
        async with EmbeddedBroker(token=TOKEN, scheduler_token=SCHEDULER_TOKEN) as embedded:
            yield embedded.url
    else:
        users = {SCHEDULER_USER: SCHEDULER_TOKEN, **peers}
        mosquitto = Mosquitto(tmp_path, acl=True, users=users)
        await asyncio.to_thread(mosquitto.start)
        try:
            yield mosquitto.url
        finally:
            await asyncio.to_thread(mosquitto.stop)


# -------------------------------------------------------------------------- the scheduler's own


@pytest.mark.parametrize("kind", ["amqtt", "mosquitto"])
async def test_the_swarm_token_does_not_log_in_as_the_scheduler(kind: str, tmp_path: Path) -> None:
    async with _broker(kind, tmp_path, {"a": TOKEN}) as url:
        async with bus(url, "thief", token=TOKEN, username=SCHEDULER_USER) as thief:
            with pytest.raises(BusAuthError, match="refused"):
                await thief.wait_connected(WAIT_S)
        async with bus(url, "scheduler", token=SCHEDULER_TOKEN, username=SCHEDULER_USER) as own:
            await own.wait_connected(WAIT_S)
            jobs = own.subscribe(TOPICS.job(ANY))
            await jobs.wait_subscribed(WAIT_S)
            await own.publish(TOPICS.job("j"), pb.JobAnnouncement(job="j"), retain=True)
            async with asyncio.timeout(WAIT_S):
                assert (await anext(jobs))[0] == TOPICS.job("j")


async def test_an_embedded_broker_with_a_token_makes_the_schedulers_own() -> None:
    """Nobody passed one: the broker makes one, for a scheduler in its own process."""
    async with EmbeddedBroker(token=TOKEN) as broker:
        made = broker.scheduler_token
        assert made and made != TOKEN
        async with bus(broker.url, "thief", token=TOKEN, username=SCHEDULER_USER) as thief:
            with pytest.raises(BusAuthError):
                await thief.wait_connected(WAIT_S)
        async with bus(broker.url, "scheduler", token=made, username=SCHEDULER_USER) as own:
            await own.wait_connected(WAIT_S)
    async with EmbeddedBroker() as open_broker:  # without a token: open, as before
        assert open_broker.scheduler_token is None


# --------------------------------------------------------------- a peer's own password is sent


def test_the_urls_password_wins_over_the_token() -> None:
    settings = BusSettings()
    own = Dialer.create(parse_broker_url("mqtt://a:mine@h"), "peer-a", settings, token=TOKEN)
    assert (own.username, own.password) == ("a", "mine")
    shared = Dialer.create(
        parse_broker_url("mqtt://h"), "peer-a", settings, token=TOKEN, username="a"
    )
    assert (shared.username, shared.password) == ("a", TOKEN)
    tool = Dialer.create(parse_broker_url("mqtt://h"), "tool", settings, token=TOKEN)
    assert (tool.username, tool.password) == ("swarm", TOKEN)


async def test_a_peer_logs_in_with_its_own_password(tmp_path: Path) -> None:
    """Mosquitto with a password per peer: the peer's URL carries its own, `--token` (which
    the peer also needs for gRPC) must not replace it."""
    async with (
        _broker("mosquitto", tmp_path, {"a": "a-only"}) as url,
        bus(url, "scheduler", token=SCHEDULER_TOKEN, username=SCHEDULER_USER) as scheduler,
        bus(_with_login(url, "a", "a-only"), "peer-a", token=TOKEN, username="a") as a,
    ):
        await scheduler.wait_connected(WAIT_S)
        peers = scheduler.subscribe(TOPICS.peer(ANY))
        await peers.wait_subscribed(WAIT_S)
        await a.wait_connected(WAIT_S)
        await a.publish(TOPICS.peer("a"), pb.PeerAnnouncement(address="a:1"), retain=True)
        async with asyncio.timeout(WAIT_S):
            assert (await anext(peers))[0] == TOPICS.peer("a")


# --------------------------------------------------------- the certificate's name is the user


@pytest.fixture
def pki(tmp_path: Path) -> Iterator[Path]:
    """A swarm CA with certificates named broker, scheduler and a; no identity is left behind."""
    yield named_ca(tmp_path, "broker", "scheduler", "a")
    tls.configure(None)


async def test_the_client_certificate_names_the_user(pki: Path) -> None:
    """use_identity_as_username: a client with certificate "scheduler" is the scheduler (its
    certificate is its credential, beside the swarm token); a client with certificate "a"
    is peer a, whatever username it sends."""
    become(pki, "broker")
    async with EmbeddedBroker(token=TOKEN, use_identity_as_username=True) as broker:
        become(pki, "scheduler")  # each Bus takes the identity current when it is made
        scheduler = bus(broker.url, "scheduler", token=TOKEN, username="whoever")
        become(pki, "a")
        liar = bus(broker.url, "peer-a", token=TOKEN, username=SCHEDULER_USER)
        async with scheduler, liar:
            await scheduler.wait_connected(WAIT_S)
            await liar.wait_connected(WAIT_S)
            everything = scheduler.subscribe(TOPICS.everything())
            await everything.wait_subscribed(WAIT_S)
            await liar.publish(TOPICS.job("j"), pb.JobAnnouncement(job="j"), retain=True)
            await liar.publish(TOPICS.peer("a"), pb.PeerAnnouncement(address="a:1"))
            async with asyncio.timeout(WAIT_S):  # its own topic only
                assert (await anext(everything))[0] == TOPICS.peer("a")
            await scheduler.publish(TOPICS.job("j"), pb.JobAnnouncement(job="j"))
            async with asyncio.timeout(WAIT_S):
                assert (await anext(everything))[0] == TOPICS.job("j")


async def test_certificate_users_need_mutual_tls(pki: Path) -> None:
    tls.configure(tls.Tls.load(pki / "ca.pem", pki / "broker.pem", pki / "broker.key"))
    with pytest.raises(ConfigError, match="--tls-mutual"):
        await EmbeddedBroker(token=TOKEN, use_identity_as_username=True).start()
