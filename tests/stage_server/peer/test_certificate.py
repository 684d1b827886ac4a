"""A stage server's own certificate checked at start (`stage_server.peer.certificate`): behind NAT
it is verified by its peer id, dialled directly by its announced host; one its callers would
refuse stops it with the `swarm certs issue` line that fixes it (before, the guide's home peer
started with a certificate for 192.168.1.10, announced 127.0.0.1, logged "attached to relay" and
never got work)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stage_server.peer.certificate import check_own_certificate
from swarm.errors import ConfigError
from swarm.net import tls
from swarm.net.certs import init_ca, issue
from tests.support.cli import swarm


@pytest.fixture
def ca(tmp_path: Path) -> Path:
    init_ca(tmp_path)
    issue(tmp_path, "by-peer", [], peers=["home-gpu-1"])
    issue(tmp_path, "by-host", ["203.0.113.7"])
    issue(tmp_path, "lan", ["192.168.1.10"])
    issue(tmp_path, "both", ["203.0.113.7"], peers=["home-gpu-1"])
    return tmp_path


def _identity(ca: Path, name: str) -> tls.Tls:
    return tls.Tls.load(ca / "ca.pem", ca / f"{name}.pem", ca / f"{name}.key")


@pytest.mark.parametrize(
    ("cert", "host", "behind_nat"),
    [
        ("by-peer", "127.0.0.1", True),  # the guide's home peer: reached through a relay
        ("by-peer", "127.0.0.1", False),  # found unreachable, then relayed
        ("by-host", "203.0.113.7", False),  # a public peer, dialled directly
        ("both", "203.0.113.7", True),
    ],
)
def test_a_certificate_its_callers_accept_starts(
    ca: Path, cert: str, host: str, behind_nat: bool
) -> None:
    check_own_certificate(_identity(ca, cert), host, "home-gpu-1", behind_nat)


def test_a_certificate_naming_neither_its_host_nor_its_id_stops_it_with_the_fix(
    ca: Path,
) -> None:
    """The issue's home peer: a certificate for its LAN address, announcing loopback."""
    with pytest.raises(ConfigError) as refused:
        check_own_certificate(_identity(ca, "lan"), "127.0.0.1", "home-gpu-1", False)
    said = str(refused.value)
    assert "names 192.168.1.10: neither 127.0.0.1" in said
    assert "swarm certs issue NAME --peer home-gpu-1`" in said  # loopback names no machine
    with pytest.raises(ConfigError, match=r"--peer home-gpu-1 --host 203\.0\.113\.9`"):
        check_own_certificate(_identity(ca, "lan"), "203.0.113.9", "home-gpu-1", False)


def test_a_peer_started_without_the_id_its_certificate_names_is_told_that_id(ca: Path) -> None:
    """`--peer` left out: the id is made up, and the certificate says which it should be."""
    with pytest.raises(ConfigError, match="start it with --peer home-gpu-1, the peer id"):
        check_own_certificate(_identity(ca, "by-peer"), "127.0.0.1", "box-1a2b3c4d", True)


def test_behind_nat_a_certificate_without_its_peer_id_stops_it(ca: Path) -> None:
    """Its address is private: callers through the relay verify the id, whatever host it names."""
    with pytest.raises(ConfigError, match=r"behind NAT \(--behind-nat\).*--peer home-gpu-1`"):
        check_own_certificate(_identity(ca, "lan"), "192.168.1.10", "home-gpu-1", True)


def test_without_tls_or_a_certificate_nothing_is_checked(ca: Path) -> None:
    check_own_certificate(None, "127.0.0.1", "p", True)
    check_own_certificate(tls.Tls.load(ca / "ca.pem"), "127.0.0.1", "p", True)


def test_the_guides_old_home_peer_stops_at_start_with_the_fix(ca: Path, tmp_path: Path) -> None:
    """`swarm stage-server` as the issue ran it: a certificate for the LAN address, announcing
    loopback. It used to start, log "attached to relay" and never get work; now it stops before
    it dials the broker (none listens there), saying what to issue."""
    lan = {"SWARM_TLS_CA": str(ca / "ca.pem"), "SWARM_TLS_CERT": str(ca / "lan.pem")}
    lan |= {"SWARM_TLS_KEY": str(ca / "lan.key"), "SWARM_CACHE_DIR": str(tmp_path / "cache")}
    done = swarm(
        *("stage-server", "--broker", "mqtts://127.0.0.1:9", "--device", "cpu"),
        *("--peer", "home-gpu-1", "--token", "t"),
        env=lan,
        check=False,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "swarm certs issue NAME --peer home-gpu-1" in done.stderr, done.stderr
