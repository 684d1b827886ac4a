"""Real Mosquitto on the files `swarm broker-config` writes (`swarm.bus.broker_config.write`):
a swarm CA with a broker certificate for 127.0.0.1 (the `broker_certs` fixture), the broker
running on the written files (`written_mosquitto`), and a raw TLS login to it, one CONNECT and
no reconnects, unlike a `Bus` (`WrittenBroker.connect`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import ssl
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from swarm.bus.broker_config import write
from swarm.net import tls
from swarm.net.certs import init_ca, issue
from tests.support.brokers import running
from tests.support.buses import WAIT_S
from tests.support.ports import free_port
from tests.support.raw_mqtt import RawClient, connect_packet

__all__ = ["ME", "SCHEDULER_TOKEN", "TOKEN", "WrittenBroker", "broker_certs", "written_mosquitto"]

TOKEN, SCHEDULER_TOKEN = "s3cret", "sched-only"
"""The swarm token and the scheduler's own password the files are written with."""
ME = pwd.getpwuid(os.geteuid()).pw_name
"""Who the broker runs as: no dropping of privileges here (the system test does that)."""
HOST = "127.0.0.1"


@pytest.fixture
def broker_certs(tmp_path: Path) -> Iterator[Path]:
    """A swarm CA and a broker certificate for 127.0.0.1; the swarm's clients trust the CA."""
    path = tmp_path / "certs"
    init_ca(path)
    issue(path, "broker", [HOST])
    tls.configure(tls.Tls.load(path / "ca.pem", None, None, False))
    yield path
    tls.configure(None)


@dataclass(frozen=True)
class WrittenBroker:
    """Mosquitto running on the written `files` (`files[0]` its conf), logging to `log`."""

    port: int
    files: list[Path]
    log: Path
    certs: Path

    @property
    def url(self) -> str:
        return f"mqtts://{HOST}:{self.port}"

    async def connect(
        self, user: str, password: str = TOKEN, client_id: str | None = None
    ) -> RawClient:
        """A TLS connection sending one CONNECT as `user` (client id `c-{user}` unless given);
        its CONNACK read and accepted."""
        context = ssl.create_default_context(cafile=str(self.certs / "ca.pem"))
        raw = RawClient(*await asyncio.open_connection(HOST, self.port, ssl=context))
        await raw.send(connect_packet(client_id or f"c-{user}", username=user, password=password))
        assert await raw.connack(WAIT_S) == 0, f"{user} was refused"
        return raw


@contextlib.contextmanager
def written_mosquitto(
    where: Path,
    certs: Path,
    peers: Mapping[str, str | None],
    *,
    tool: str | None = None,
    trainers: Iterable[str] = (),
) -> Iterator[WrittenBroker]:
    """Write the broker's files into `where`/broker for `peers` (id -> own password or None:
    the swarm token) on a free port, and run Mosquitto on them for the block."""
    port = free_port(HOST)
    files = write(
        where / "broker",
        certs=certs,
        cert="broker",
        port=port,
        peers=dict(peers),
        token=TOKEN,
        scheduler_password=SCHEDULER_TOKEN,
        user=ME,
        tool=tool,
        trainers=trainers,
    )
    with running(files[0], port) as log:
        yield WrittenBroker(port, files, log, certs)
