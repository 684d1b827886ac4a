"""TLS with the swarm's own CA (`swarm certs`): real stage-server processes, the real embedded
broker and Mosquitto. A peer with a certificate from another CA, an expired one, or none where
one is required is refused, and the refusal is counted; the token keeps working beside TLS."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509
from prometheus_client import CollectorRegistry

from swarm.bus.broker import EmbeddedBroker
from swarm.bus.connection import Bus, BusRefused, BusSettings
from swarm.cli import main
from swarm.errors import ConfigError
from swarm.net import tls
from tests.support.brokers import Mosquitto
from tests.support.tls import REFUSED_SOCKETS, load_identity, no_identity  # noqa: F401

FAST = BusSettings(keepalive_s=2, operation_timeout_s=3.0, close_timeout_s=3.0)


def test_certs_init_and_issue_make_a_ca_and_host_certificates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "certs"
    assert main(["certs", "init", "--dir", str(d)]) == 0
    assert (
        main(
            ["certs", "issue", "peer1", "--host", "10.0.0.7", "--host", "gpu1.lab", "--dir", str(d)]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "--tls-cert" in out and (d / "ca.key").stat().st_mode & 0o777 == 0o600
    ca = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    cert = x509.load_pem_x509_certificate((d / "peer1.pem").read_bytes())
    cert.verify_directly_issued_by(ca)  # raises if the CA did not sign it
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    assert names.get_values_for_type(x509.DNSName) == ["gpu1.lab"]
    assert (d / "peer1.key").stat().st_mode & 0o777 == 0o600
    # A second init would void every certificate issued: refused, nothing overwritten.
    before = (d / "ca.pem").read_bytes()
    assert main(["certs", "init", "--dir", str(d)]) == 2
    assert "already holds a CA" in capsys.readouterr().err and (d / "ca.pem").read_bytes() == before
    assert main(["certs", "issue", "x", "--host", "h", "--dir", str(tmp_path / "none")]) == 2
    assert "swarm certs init --dir" in capsys.readouterr().err
    assert main(["certs", "issue", "x", "--dir", str(d)]) == 2
    assert "at least one --host" in capsys.readouterr().err


def test_a_peer_behind_nat_is_issued_a_certificate_naming_its_peer_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--peer ID` names the id callers through a relay verify it by (`ID.peer.swarm`), with or
    without a host; --help says a NAT'd stage server needs it."""
    d = tmp_path / "certs"
    assert main(["certs", "init", "--dir", str(d)]) == 0
    assert main(["certs", "issue", "home-gpu-1", "--peer", "Home-GPU-1", "--dir", str(d)]) == 0
    out = capsys.readouterr().out
    assert "peer Home-GPU-1 (home-gpu-1.peer.swarm)" in out and "--peer Home-GPU-1" in out
    cert = x509.load_pem_x509_certificate((d / "home-gpu-1.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["home-gpu-1.peer.swarm"]
    identity = tls.Tls.load(d / "ca.pem", d / "home-gpu-1.pem", d / "home-gpu-1.key")
    assert identity.names("home-gpu-1.peer.swarm") and not identity.names("192.168.1.10")
    assert main(["certs", "issue", "bad", "--peer", "a/b", "--dir", str(d)]) == 2
    assert "--peer 'a/b'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["certs", "--help"])
    assert "behind NAT needs one" in " ".join(capsys.readouterr().out.split())


def test_issuing_never_overwrites_the_ca_or_an_issued_certificate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `swarm certs issue ca` wrote ca.pem and ca.key over the CA's own: every certificate it had
    # issued stopped verifying, and its key was gone.
    d = tmp_path / "certs"
    assert main(["certs", "init", "--dir", str(d)]) == 0
    ca = (d / "ca.pem").read_bytes(), (d / "ca.key").read_bytes()
    assert main(["certs", "issue", "ca", "--host", "h", "--dir", str(d)]) == 2
    assert "ca.pem" in capsys.readouterr().err
    assert ((d / "ca.pem").read_bytes(), (d / "ca.key").read_bytes()) == ca
    assert main(["certs", "issue", "peer1", "--host", "h", "--dir", str(d)]) == 0
    issued = (d / "peer1.pem").read_bytes(), (d / "peer1.key").read_bytes()
    assert main(["certs", "issue", "peer1", "--host", "other", "--dir", str(d)]) == 2
    assert "peer1.pem already exists" in capsys.readouterr().err
    assert ((d / "peer1.pem").read_bytes(), (d / "peer1.key").read_bytes()) == issued


def test_identities_are_checked_when_loaded(pki: Path) -> None:
    ours, theirs = pki / "ours", pki / "theirs"
    with pytest.raises(ConfigError, match="not issued by the CA"):
        tls.Tls.load(ours / "ca.pem", theirs / "server.pem", theirs / "server.key")
    with pytest.raises(ConfigError, match=r"is valid .* not now"):
        tls.Tls.load(ours / "ca.pem", ours / "expired.pem", ours / "expired.key")
    with pytest.raises(ConfigError, match="is not the key of"):
        tls.Tls.load(ours / "ca.pem", ours / "server.pem", ours / "client.key")
    with pytest.raises(ConfigError, match="go together"):
        tls.Tls.load(ours / "ca.pem", ours / "server.pem")
    with pytest.raises(ConfigError, match="--tls-mutual needs"):
        tls.Tls.load(ours / "ca.pem", mutual=True)
    with pytest.raises(ConfigError, match="cannot be read"):
        tls.Tls.load(ours / "nothing.pem")


async def _connect(url: str, timeout: float = 6.0) -> None:
    """Connected to the broker at `url` within `timeout`, else what the bus raised."""
    async with Bus(url, "tls-test", registry=CollectorRegistry(), settings=FAST) as bus:
        await bus.wait_connected(timeout)


NO_CERTIFICATE = r"TLS refused: the broker at mqtts://\S+ requires a client certificate"
NOT_OUR_CA = (
    r"TLS refused: the certificate of the broker at \S+ was not issued by the CA of --tls-ca"
)


@REFUSED_SOCKETS
async def test_the_embedded_broker_serves_mqtts_to_the_swarm_ca_only(pki: Path) -> None:
    tls.configure(load_identity(pki, "ours", "server", mutual=True))
    async with EmbeddedBroker("127.0.0.1", 0) as broker:
        assert broker.url.startswith("mqtts://")
        await _connect(broker.url)  # our CA, our certificate
        tls.configure(load_identity(pki, "ours", None))  # no certificate: mutual refuses it
        with pytest.raises(BusRefused, match=NO_CERTIFICATE):
            await _connect(broker.url, 3.0)
        tls.configure(load_identity(pki, "theirs", "their-client"))  # a stranger's CA
        with pytest.raises(BusRefused, match=NOT_OUR_CA):
            await _connect(broker.url, 3.0)


@REFUSED_SOCKETS
async def test_mosquitto_serves_mqtts_to_the_swarm_ca_only(tmp_path: Path, pki: Path) -> None:
    server = load_identity(pki, "ours", "server", mutual=True)
    with Mosquitto(tmp_path / "mosquitto", tls=server) as mosquitto:
        assert mosquitto.url.startswith("mqtts://")
        tls.configure(load_identity(pki, "ours", "client"))
        await _connect(mosquitto.url)
        tls.configure(load_identity(pki, "ours", None))
        with pytest.raises(BusRefused, match=NO_CERTIFICATE):
            await _connect(mosquitto.url, 3.0)
        tls.configure(load_identity(pki, "theirs", "their-client"))
        with pytest.raises(BusRefused, match=NOT_OUR_CA):
            await _connect(mosquitto.url, 3.0)
