"""TLS material for tests: the swarm's CA with a server, a client and an expired certificate, a
stranger CA with its own (`pki`), the process identity a test loads from them (`load_identity`,
or `unchecked` to show what `Tls.load` refuses), and none left to the next test (`no_identity`);
the environment that gives a swarm process the server certificate (`mutual_env`); a CA with
certificates of the names a test gives (`named_ca`), becoming one of them (`become`), and the
`tls_identity` fixture: this process serves and dials TLS as a fresh CA's "broker"."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarm.net import tls
from swarm.net.certs import init_ca, issue

__all__ = [
    "HOSTS",
    "REFUSED_SOCKETS",
    "become",
    "load_identity",
    "mutual_env",
    "named_ca",
    "no_identity",
    "pki",
    "tls_identity",
    "unchecked",
]

HOSTS = ["127.0.0.1", "localhost"]

# paho (under aiomqtt) drops the TLS socket of a refused handshake without closing it, in its
# connect thread; the collector closes it (a ResourceWarning, not a descriptor kept).
REFUSED_SOCKETS = pytest.mark.filterwarnings("ignore:unclosed <ssl.SSLSocket:ResourceWarning")


@pytest.fixture(autouse=True)
def no_identity() -> Iterator[None]:
    """Each test sets the process's identity it needs; none is left to the next (autouse in
    every module that imports it)."""
    tls.configure(None)
    yield
    tls.configure(None)


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    """The swarm's CA with a server and a client certificate, and a stranger CA with one."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    init_ca(ours)
    issue(ours, "server", HOSTS)
    issue(ours, "client", HOSTS)
    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=30)
    issue(ours, "expired", HOSTS, days=1, valid_from=past)
    init_ca(theirs)
    issue(theirs, "server", HOSTS)
    issue(theirs, "client", HOSTS)
    return tmp_path


def load_identity(pki: Path, ca: str, name: str | None, mutual: bool = False) -> tls.Tls:
    """The identity trusting `pki/CA` ("ours" or "theirs") and showing certificate `name`
    ("their-NAME" for the stranger's), or none."""
    cert = key = None
    if name is not None:
        owner = "theirs" if name.startswith("their-") else "ours"
        base = name.removeprefix("their-")
        cert, key = pki / owner / f"{base}.pem", pki / owner / f"{base}.key"
    return tls.Tls.load(pki / ca / "ca.pem", cert, key, mutual)


def unchecked(identity: tls.Tls, pki: Path, name: str) -> tls.Tls:
    """`identity` showing `pki/ours/NAME` (which `Tls.load` would refuse: expired)."""
    cert, key = pki / "ours" / f"{name}.pem", pki / "ours" / f"{name}.key"
    return tls.Tls(
        identity.ca, cert.read_bytes(), key.read_bytes(), False, identity.ca_path, cert, key
    )


def mutual_env(pki: Path, token: str) -> dict[str, str]:
    """The environment of a swarm process that serves and connects with `pki`'s own server
    certificate, mutual TLS, and the swarm's `token`."""
    ours = pki / "ours"
    return {
        "SWARM_TLS_CA": str(ours / "ca.pem"),
        "SWARM_TLS_CERT": str(ours / "server.pem"),
        "SWARM_TLS_KEY": str(ours / "server.key"),
        "SWARM_TLS_MUTUAL": "1",
        "SWARM_TOKEN": token,
    }


def named_ca(path: Path, *names: str) -> Path:
    """A swarm CA in `path` with a certificate for 127.0.0.1 named each of `names`; `path`."""
    init_ca(path)
    for name in names:
        issue(path, name, ["127.0.0.1"])
    return path


def become(pki: Path, name: str) -> None:
    """This process's TLS identity (mutual) becomes certificate `name` of `named_ca`'s `pki`."""
    pem, key = pki / f"{name}.pem", pki / f"{name}.key"
    tls.configure(tls.Tls.load(pki / "ca.pem", pem, key, mutual=True))


@pytest.fixture
def tls_identity(tmp_path: Path) -> Iterator[None]:
    """This process serves (and dials) TLS with a certificate of a fresh swarm CA, for one
    test (not mutual)."""
    pki = named_ca(tmp_path, "broker")
    tls.configure(tls.Tls.load(pki / "ca.pem", pki / "broker.pem", pki / "broker.key"))
    yield
    tls.configure(None)
