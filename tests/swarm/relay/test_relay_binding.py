"""H-relay (issue 54): a relay binds an attachment to who made it. A token holder attaching under a
live peer's id takes none of its calls, nor a certificate for the peer's colliding private address
under TLS, nor a hostile relay passing the relay's challenge on; and a NAT'd peer that loses a live
relay goes back to it, not to the relay announced last. The caller's own check of the peer id
(`PEER.peer.swarm`) is test_relay.py's `test_a_relayed_peer_is_verified_by_its_peer_id...`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from stage_server.peer.reachability import PeerPath
from swarm.net import tls
from swarm.proto import control_pb2 as cpb
from swarm.relay.attach import Attachment
from swarm.relay.identity import AttachKey
from swarm.relay.server import RelayLimits, RelayServer
from tests.support.relays import (
    NAT_HOST,
    echo_bytes,
    echo_server,
    home_peer,
    listener,
    raw_attach,
    relayed,
)
from tests.support.tls import no_identity
from tests.support.waiting import wait_until

__all__ = ["no_identity"]  # autouse: no TLS identity left to the next test

TOKEN = "relay-binding-token"
pytestmark = pytest.mark.timeout(120)


async def _relay() -> tuple[RelayServer, str, CollectorRegistry]:
    """A relay on 127.0.0.1: it, its address and its metrics."""
    registry = CollectorRegistry()
    relay = RelayServer(TOKEN, registry=registry)
    return relay, f"127.0.0.1:{await relay.start('127.0.0.1', 0)}", registry


def _refused(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("swarm_relay_refused_total", {"reason": reason}) or 0


@pytest.mark.attack("H-relay")
async def test_a_token_holder_attaching_as_a_live_peer_takes_none_of_its_calls() -> None:
    """Before: the newer attachment won, and the attacker's server got the peer's calls."""
    async with (
        echo_server(TOKEN) as port,
        relayed(TOKEN, port) as r,
        listener() as (theirs, stolen),
    ):
        await wait_until(lambda: r.attachment.relay is not None)
        attacker = Attachment(
            r.peer, TOKEN, f"127.0.0.1:{theirs}", lambda: [r.relay_address], lambda _: None
        )
        await attacker.start()
        try:
            await wait_until(
                lambda: attacker.relay is not None or _refused(r.registry, "taken") >= 2,
                "the attacker's attach refused, twice",
            )
            assert attacker.relay is None
            for i in range(10):
                assert await echo_bytes(r.address, TOKEN, [b"%d" % i]) == [b"%d" % i]
            assert stolen == []
        finally:
            await attacker.stop()


@pytest.fixture
def colliding(tmp_path: Path) -> Iterator[Path]:
    """One swarm CA: `victim` names the NAT'd peer's id and its private address; `mallory`, a
    peer of the same swarm in another home, the same private address and its own id."""
    from swarm.net.certs import init_ca, issue

    init_ca(tmp_path)
    issue(tmp_path, "victim", ["192.168.1.20"], peers=["home-gpu"])
    issue(tmp_path, "mallory", ["192.168.1.20"], peers=["mallory"])
    yield tmp_path
    tls.configure(None)


def _identity(pki: Path, name: str) -> tls.Tls:
    return tls.Tls.load(pki / "ca.pem", pki / f"{name}.pem", pki / f"{name}.key")


@pytest.mark.attack("H-relay")
async def test_under_tls_only_a_certificate_naming_the_peer_id_attaches_as_it(
    colliding: Path,
) -> None:
    """A relay with the swarm's CA takes an attachment as `home-gpu` from a certificate naming
    `home-gpu.peer.swarm` only: a same-CA certificate for the same private address is not it,
    before the peer attached or while it is."""
    registry = CollectorRegistry()
    relay = RelayServer(TOKEN, registry=registry, ca=_identity(colliding, "victim").ca)
    address = f"127.0.0.1:{await relay.start('127.0.0.1', 0)}"
    mallory = Attachment(
        "home-gpu",
        TOKEN,
        "127.0.0.1:1",
        lambda: [address],
        lambda _: None,
        key=AttachKey.of(_identity(colliding, "mallory")),
    )
    try:
        await mallory.start()
        await wait_until(lambda: _refused(registry, "identity") >= 1 or relay.peers)
        assert relay.peers == {}
        tls.configure(_identity(colliding, "victim"))
        async with home_peer(address, TOKEN, key=AttachKey.of(tls.current())):
            before = _refused(registry, "identity")
            await wait_until(lambda: _refused(registry, "identity") > before)
            assert list(relay.peers) == ["home-gpu"] and mallory.relay is None
    finally:
        await mallory.stop()
        await relay.stop()


@pytest.mark.attack("H-relay")
async def test_a_hostile_relay_cannot_pass_the_relays_challenge_on() -> None:
    """A token holder's relay that the peer attaches to attaches as the peer to the real relay
    itself, handing the peer the real relay's challenge: the peer's answer names the relay it
    dialled, so the real relay refuses it."""
    real, real_address, registry = await _relay()

    async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", int(real_address.split(":")[1]))
        try:
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                head += await reader.readline()
            up_w.write(head)
            writer.write(await up_r.readline())  # the real relay's NONCE
            up_w.write(await reader.readline())  # the peer's PROOF for it
            writer.write(await up_r.readline())
            await writer.drain()
            await reader.read()
        finally:
            up_w.close()
            writer.close()

    hostile = await asyncio.start_server(forward, "127.0.0.1", 0)
    hostile_address = f"127.0.0.1:{hostile.sockets[0].getsockname()[1]}"
    victim = Attachment("home-gpu", TOKEN, "127.0.0.1:1", lambda: [hostile_address], lambda _: None)
    await victim.start()
    try:
        await wait_until(lambda: _refused(registry, "attach") >= 1 or real.peers)
        assert real.peers == {}
    finally:
        await victim.stop()
        hostile.close()
        await real.stop()


def _relay_announcement(peer: str, address: str) -> cpb.PeerAnnouncement:
    return cpb.PeerAnnouncement(
        peer=peer, role=cpb.PEER_ROLE_RELAY, relay_address=address, state=cpb.PEER_STATE_SERVING
    )


@pytest.mark.attack("H-relay")
async def test_a_nat_peer_keeps_the_relay_the_scheduler_reported() -> None:
    """The peer is reached through relay `good` (the scheduler says so); a token holder then
    announces relay `bad` and attaches to `good` as the peer. Before, the newer attachment won
    and the kicked peer took the relay announced last: `bad`, for good."""
    good, good_address, registry = await _relay()
    bad, bad_address, _ = await _relay()
    async with echo_server(TOKEN) as port, listener() as (theirs, stolen):
        path = PeerPath(
            "home-gpu",
            f"{NAT_HOST}:{port}",
            local=f"127.0.0.1:{port}",
            token=TOKEN,
            behind_nat=True,
        )
        attacker = Attachment(
            "home-gpu", TOKEN, f"127.0.0.1:{theirs}", lambda: [good_address], lambda _: None
        )
        try:
            await path.on_announcement(_relay_announcement("good", good_address))
            await wait_until(lambda: path.relay == good_address)
            await path.on_report(
                cpb.ReachabilityReport(
                    peer="home-gpu", reachability=cpb.REACHABILITY_RELAYED, relay=good_address
                )
            )
            await path.on_announcement(_relay_announcement("bad", bad_address))
            await attacker.start()
            await wait_until(lambda: attacker.relay is not None or _refused(registry, "taken") >= 1)
            assert path.relays()[0] == good_address
            assert path.relay == good_address and list(bad.peers) == []
            assert list(good.peers) == ["home-gpu"] and attacker.relay is None
        finally:
            await attacker.stop()
            await path._detach("the test ends")
            await good.stop()
            await bad.stop()
    assert stolen == []


async def test_a_peer_kicked_off_a_live_relay_goes_back_to_it() -> None:
    """Its own identity attaching again elsewhere (its restart, a second link) takes its place;
    the peer then tries that relay again first, before any announced since, and the newer wins
    again: it stays where the scheduler found it."""
    async with echo_server(TOKEN) as port:
        first, a, registry = await _relay()
        later, b, _ = await _relay()
        relays = [a]
        peer = Attachment("home-gpu", TOKEN, f"127.0.0.1:{port}", lambda: relays, lambda _: None)
        once = iter([[a]])  # the twin attaches once and never again
        twin = Attachment(
            "home-gpu",
            TOKEN,
            f"127.0.0.1:{port}",
            lambda: next(once, []),
            lambda _: None,
            key=peer.key,
        )
        try:
            await peer.start()
            await wait_until(lambda: peer.relay == a)
            relays.insert(0, b)  # announced since: listed first
            await twin.start()
            await wait_until(
                lambda: (registry.get_sample_value("swarm_relay_attaches_total") or 0) >= 3,
                "the peer, its twin, the peer again",
            )
            # The relay counts the peer's attach as it closes the twin's connection; the twin
            # learns it lost its place when it reads that close, in a turn of its own.
            await wait_until(lambda: twin.relay is None, "the twin saw its attachment end")
            assert peer.relay == a and list(first.peers) == ["home-gpu"]
            assert list(later.peers) == []
        finally:
            await peer.stop()
            await twin.stop()
            await first.stop()
            await later.stop()


async def test_a_restarted_peer_takes_its_id_back_from_its_dead_attachment() -> None:
    """Its old process's attachment no longer answers (its machine lost power; the relay has not
    seen the connection end): the new process, with a new key, is not kept out for good."""
    registry = CollectorRegistry()
    relay = RelayServer(TOKEN, RelayLimits(probe_s=0.5), registry=registry)
    address = f"127.0.0.1:{await relay.start('127.0.0.1', 0)}"
    try:
        answer, (dead, old) = await raw_attach(address, "home-gpu", TOKEN)  # answers no ping
        assert answer == "OK"
        async with home_peer(address, TOKEN) as (restarted, relayed):
            assert await echo_bytes(relayed, TOKEN, [b"back"]) == [b"back"]
            assert restarted.relay == address and _refused(registry, "taken") == 0
            # The old connection pinged (unanswered), then closed by the relay.
            assert set((await dead.read()).split()) == {b"PING"}
    finally:
        old.close()
        await relay.stop()
