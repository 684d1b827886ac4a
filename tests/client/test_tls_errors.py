"""TLS on one side only, and a missing client certificate, against a real job API server (TLS,
mutual TLS, or clear text): `swarm jobs` names the cause and the flags that fix it instead of
"Socket closed", and a remote trainer gives up at once instead of asking again for minutes."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from unittest import mock

import grpc
import pytest

from client.remote import RemoteCoordinator
from client.sdk import ClientError, SchedulerClient
from scheduler.job_api import JobApiServicer
from scheduler.store import JobStore
from swarm.cli import main
from swarm.errors import ConfigError
from swarm.net import tls
from swarm.net.tls_mismatch import explain_grpc
from swarm.net.tokens import add_port
from swarm.proto import scheduler_pb2_grpc
from tests.support.api import FakeControl
from tests.support.ports import free_address
from tests.support.tls import load_identity, no_identity, unchecked  # noqa: F401

pytestmark = pytest.mark.timeout(60)

Serve = Callable[[str], Awaitable[str]]


@pytest.fixture
async def serve(tmp_path: Path, pki: Path) -> AsyncIterator[Serve]:
    """`await serve(kind)`: the job API's address, served in clear text ("plain"), over TLS
    ("tls") or mutual TLS ("mutual") with the swarm CA's server certificate."""
    servers: list[grpc.aio.Server] = []
    stores: list[JobStore] = []

    async def start(kind: str) -> str:
        store = JobStore(tmp_path / f"{kind}.sqlite")
        server = grpc.aio.server()
        servicer = JobApiServicer(store, FakeControl(store), data_root=tmp_path)
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
        # The credentials are the process's identity when the port is added, not later.
        identity = (
            None if kind == "plain" else load_identity(pki, "ours", "server", kind == "mutual")
        )
        tls.configure(identity)
        port = add_port(server, "127.0.0.1:0", "the job API")
        tls.configure(None)
        await server.start()
        servers.append(server)
        stores.append(store)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        await server.stop(None)
    for store in stores:
        store.close()


async def jobs(address: str, *flags: str) -> int:
    """`swarm jobs` as the command runs it (its TLS flags set the process's identity)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    with mock.patch.dict(os.environ, environ, clear=True):
        return await asyncio.to_thread(main, ["jobs", "--scheduler", address, *flags])


def _flags(pki: Path, *names: str) -> list[str]:
    ours = pki / "ours"
    flags = ["--tls-ca", str(ours / "ca.pem")]
    for name in names:
        flags += ["--tls-cert", str(ours / f"{name}.pem"), "--tls-key", str(ours / f"{name}.key")]
    return flags


@pytest.mark.parametrize(
    ("server", "client", "said"),
    [
        ("tls", (), "serves TLS and this process does not: give --tls-ca with the swarm's CA"),
        ("mutual", (), "serves TLS with client certificates (--tls-mutual) and this process"),
        ("mutual", ("ca",), "TLS refused: the scheduler at {} requires a client certificate"),
        ("plain", ("ca",), "does not serve TLS and this process does (--tls-ca): leave out"),
    ],
    ids=["clear-to-tls", "clear-to-mutual", "no-certificate-to-mutual", "tls-to-clear"],
)
async def test_tls_on_one_side_only_is_named_with_the_flags_to_pass(
    serve: Serve,
    pki: Path,
    capsys: pytest.CaptureFixture[str],
    server: str,
    client: tuple[str, ...],
    said: str,
) -> None:
    address = await serve(server)
    flags = _flags(pki) if client else []
    assert await jobs(address, *flags) == 1
    err = capsys.readouterr().err
    assert said.format(address) in err, err
    assert "Socket closed" not in err and "cannot reach" not in err
    if server == "mutual":
        assert "--tls-cert and --tls-key" in err
    # With the flags it names, the same command works.
    fixed = _flags(pki, "client") if server == "mutual" else _flags(pki) if client == () else []
    assert await jobs(address, *fixed) == 0, capsys.readouterr().err
    assert "no jobs" in capsys.readouterr().out


async def test_a_certificate_the_server_refuses_is_named(serve: Serve, pki: Path) -> None:
    address = await serve("mutual")
    # Expired since it was loaded (`Tls.load` refuses an expired one at start).
    tls.configure(unchecked(load_identity(pki, "ours", None), pki, "expired"))
    async with SchedulerClient(address) as client:
        with pytest.raises(ClientError) as caught:
            await client.list()
    assert f"TLS refused: the scheduler at {address} refused this process's certificate" in str(
        caught.value
    )
    assert "expired.pem" in str(caught.value)


async def test_a_remote_trainer_gives_up_at_once_on_tls_on_one_side_only(
    serve: Serve,
) -> None:
    address = await serve("tls")
    # It asks a scheduler that does not answer again for `retry_for_s`; this is not that.
    remote = RemoteCoordinator(address, "some-job", retry_for_s=600.0)
    try:
        with pytest.raises(ConfigError, match="serves TLS and this process does not"):
            await asyncio.wait_for(remote.job(), 20.0)
    finally:
        await remote.close()


async def test_a_closed_connection_tls_does_not_explain_gets_no_tls_hint(
    serve: Serve, pki: Path
) -> None:
    """The hints are said only when the server confirms them: a connection closed by a server
    that takes this process's certificate (restarting, say), or by nothing at all, is not TLS's
    doing, and a remote trainer keeps asking then."""
    closed = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:{}: Socket closed"
    mutual = await serve("mutual")
    tls.configure(load_identity(pki, "ours", "client"))
    assert explain_grpc(mutual, closed.format(mutual), "the scheduler") is None
    nobody = free_address()
    tls.configure(None)
    assert explain_grpc(nobody, closed.format(nobody), "the scheduler") is None
