"""What an invite certifies: one rule, every check (issue 64 item 8, issue 68 item 1;
`swarm.net.peer_names`). An invite for NAME certifies the peer ids NAME and LABEL.NAME and nothing
else: no host name, no authority's name. Before, `swarm invite scheduler` made a certificate named
`scheduler` (a job-API admin under --tls-mutual, the broker's scheduler user under
--use-identity-as-username), `swarm invite peer.swarm` one carrying `*.peer.swarm` (every relayed
peer, to a caller's TLS and to a stage server's own start check), every invite the bare host
names NAME and `*.NAME`; and a relay refused the second id the invite does certify
(`gpu1.alice`). Real relays, real gRPC with TLS, the real `swarm invite` command."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from prometheus_client import CollectorRegistry

from stage_server.peer.certificate import check_own_certificate
from swarm.errors import ConfigError
from swarm.net import invite, tls
from swarm.net.certs import init_ca, issue
from swarm.net.peer_names import barred, certifies, check_invite_name, credentials_of, own_id
from swarm.relay.attach import Attachment
from swarm.relay.identity import AttachKey
from swarm.relay.server import RelayServer
from tests.support.cli import swarm
from tests.support.relays import echo_bytes, home_peer
from tests.support.tls import no_identity
from tests.support.waiting import wait_until

__all__ = ["no_identity"]  # autouse: no TLS identity left to the next test

pytestmark = pytest.mark.timeout(120)
TOKEN = "invite-names-token"


@pytest.fixture
def ca(tmp_path: Path) -> Iterator[Path]:
    init_ca(tmp_path / "ca")
    yield tmp_path / "ca"
    tls.configure(None)


def _holder(ca: Path, name: str, where: Path) -> tls.Tls:
    """The TLS identity `--join` unpacks from an invite for `name`."""
    made = invite.make(name, "mqtts://vps:8883", "vps:7700", ca_dir=ca, hosts=[], token=TOKEN)
    files = invite.unpack(made, where / name)
    assert files.ca and files.cert and files.key
    return tls.Tls.load(files.ca, files.cert, files.key)


def _dns(identity: tls.Tls) -> list[str]:
    assert identity.cert is not None
    cert = x509.load_pem_x509_certificate(identity.cert)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return sans.get_values_for_type(x509.DNSName)


@pytest.mark.attack("64.8")
@pytest.mark.parametrize("name", ["scheduler", "peer.swarm"])
def test_swarm_invite_refuses_an_authoritys_name(ca: Path, tmp_path: Path, name: str) -> None:
    out = tmp_path / "x.invite.json"
    where = ("--broker", "mqtts://vps:8883", "--scheduler", "vps:7700", "--out", str(out))
    done = swarm(
        "invite", name, "--ca-dir", str(ca), *where, env={"SWARM_TOKEN": TOKEN}, check=False
    )
    assert done.returncode != 0 and not out.exists(), done.stdout
    assert f"invite name {name!r}" in done.stderr, done.stderr


@pytest.mark.attack("64.8")
@pytest.mark.parametrize(
    "name", ["admin", "Scheduler", "x.peer.swarm", "alice.home", "relay-vps-7100", "peer-bob", "*"]
)
def test_no_invite_certifies_a_name_outside_its_holders(ca: Path, name: str) -> None:
    with pytest.raises(ConfigError, match="invite name"):
        invite.make(name, "mqtts://vps:8883", "vps:7700", ca_dir=ca, hosts=[], token=TOKEN)


@pytest.mark.attack("64.8")
def test_an_invite_certifies_its_own_ids_and_no_host(ca: Path, tmp_path: Path) -> None:
    alice = _holder(ca, "alice", tmp_path)
    assert sorted(_dns(alice)) == ["*.alice.peer.swarm", "alice.peer.swarm"]
    assert alice.names("alice") is False and alice.names("x.alice") is False  # no host's name
    for peer, mine in [("alice", True), ("gpu1.alice", True), ("x.gpu1.alice", False)]:
        assert certifies(_dns(alice), peer) is mine and own_id(peer, "alice") is mine, peer
    for peer in ("bob", "gpu1.bob", "alicex", "alice.peer.swarm"):
        assert not certifies(_dns(alice), peer), peer
    assert check_invite_name("alice-2") == "alice-2"


@pytest.mark.attack("64.8")
def test_a_wildcard_over_every_peer_certifies_none(ca: Path, tmp_path: Path) -> None:
    """What `swarm invite peer.swarm` issued before: its holder's own stage server now stops at
    start as any peer (before, it passed its start check as `bob`)."""
    issue(ca, "old", ["peer.swarm", "*.peer.swarm", "*.peer.swarm.peer.swarm"])
    old = tls.Tls.load(ca / "ca.pem", ca / "old.pem", ca / "old.key")
    assert not certifies(_dns(old), "bob")
    with pytest.raises(ConfigError, match="not peer bob"):
        check_own_certificate(old, "127.0.0.1", "bob", behind_nat=True)


def _refused(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("swarm_relay_refused_total", {"reason": "identity"}) or 0


@pytest.mark.attack("64.8")
async def test_a_tls_relay_carries_an_invites_second_id_and_no_one_elses(
    ca: Path, tmp_path: Path
) -> None:
    """Before: `gpu1.alice` was refused ("its certificate does not name gpu1.alice.peer.swarm")."""
    alice, mallory = _holder(ca, "alice", tmp_path), _holder(ca, "mallory", tmp_path)
    registry = CollectorRegistry()
    relay = RelayServer(TOKEN, registry=registry, ca=alice.ca)
    address = f"127.0.0.1:{await relay.start('127.0.0.1', 0)}"
    posers = [
        Attachment(peer, TOKEN, "127.0.0.1:1", lambda: [address], lambda _: None, key=key)
        for peer, key in [
            ("gpu1.alice", AttachKey.of(mallory)),  # another invite's second id
            ("x.gpu1.alice", AttachKey.of(alice)),  # two labels deep: not the invite's
        ]
    ]
    try:
        for poser in posers:
            await poser.start()
        await wait_until(lambda: _refused(registry) >= 2, "both posers refused")
        assert relay.peers == {}
        tls.configure(alice)  # the second machine serves, and its caller verifies, with TLS
        async with home_peer(address, TOKEN, peer="gpu1.alice", key=AttachKey.of(alice)) as (
            _,
            dialled,
        ):
            assert list(relay.peers) == ["gpu1.alice"]
            assert await echo_bytes(dialled, TOKEN, [b"hop"]) == [b"hop"]
    finally:
        for poser in posers:
            await poser.stop()
        await relay.stop()


def test_a_banned_ids_credential_bars_every_id_its_certificate_may_certify() -> None:
    """Issue 64: where ids bind certificates, `gpu1.alice` was announced by a certificate named
    `alice` (the invite) or `gpu1.alice`; each certifies its name and one label under it."""
    creds = credentials_of("gpu1.Alice")
    assert creds == {"gpu1.alice", "alice"} and credentials_of("bob") == {"bob"}
    for peer in ("alice", "gpu2.alice", "gpu1.alice", "x.gpu1.alice", "ALICE"):
        assert barred(peer, creds), peer
    assert all(barred(p, {"alice"}) for p in ("alice", "gpu9.alice") if own_id(p, "alice"))
    for peer in ("bob", "alicex", "x.bob", "gpu1", "a.b.alice", ""):
        assert not barred(peer, creds), peer
    assert not barred("x", credentials_of("x.")), "an empty parent certifies nobody"
