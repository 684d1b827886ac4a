"""TLS with the swarm's own CA across real processes: stage servers, the embedded broker and
Mosquitto, a whole swarm over mutual TLS with the token. The checks in one process:
tests/swarm/net/test_tls.py."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from unittest import mock

import pytest
import torch

from client.sdk import SchedulerClient
from swarm.errors import PeerUnavailable, RemoteError
from swarm.job.config import load_job
from swarm.job.fingerprint import fingerprint
from swarm.local.procs import (
    SwarmProcess,
    start_local_swarm,
    start_process,
    start_stage_servers,
    stop_all,
)
from swarm.net import tls
from swarm.proto import scheduler_pb2
from swarm.rpc.stage_client import StageClient
from tests.support.cli import swarm
from tests.support.equality import assert_equal_to_local
from tests.support.jobs import write_job
from tests.support.tls import load_identity, mutual_env, no_identity, unchecked  # noqa: F401


def _server(
    tmp_path: Path, pki: Path, *, mutual: bool, token: str | None
) -> tuple[Path, SwarmProcess]:
    job = write_job(tmp_path, training={"stages": 1})
    flags = ["--tls-ca", str(pki / "ours" / "ca.pem")]
    flags += [
        "--tls-cert",
        str(pki / "ours" / "server.pem"),
        "--tls-key",
        str(pki / "ours" / "server.key"),
    ]
    flags += ["--tls-mutual"] if mutual else []
    flags += ["--token", token] if token else []
    (server,) = start_stage_servers(job, 1, log_dir=tmp_path, metrics=False, extra=flags)
    return job, server


async def _info(job: Path, address: str, token: str | None) -> int:
    client = StageClient(address, load_job(job), fingerprint(load_job(job)), 0, token)
    try:
        return (await client.info()).stage
    finally:
        await client.close()


@pytest.mark.slow
def test_a_tls_stage_server_serves_its_ca_and_refuses_strangers(tmp_path: Path, pki: Path) -> None:
    job, server = _server(tmp_path, pki, mutual=False, token="s3cret")
    try:
        tls.configure(load_identity(pki, "ours", None))  # trusts our CA, shows no certificate
        assert asyncio.run(_info(job, server.address, "s3cret")) == 0
        with pytest.raises(RemoteError, match="UNAUTHENTICATED"):  # TLS is no pass: token too
            asyncio.run(_info(job, server.address, "wrong"))
        before = tls.REFUSED._value.get()
        # trusts another CA: the server is a stranger
        tls.configure(load_identity(pki, "theirs", None))
        with pytest.raises(PeerUnavailable, match="TLS refused"):
            asyncio.run(_info(job, server.address, "s3cret"))
        assert tls.REFUSED._value.get() == before + 1
        tls.configure(None)  # clear text to a TLS port: no answer, the server hangs up
        hung_up = r"^UNAVAILABLE: .*: (Socket closed|Connection reset by peer)$"
        with pytest.raises(PeerUnavailable, match=hung_up):
            asyncio.run(_info(job, server.address, "s3cret"))
        assert tls.REFUSED._value.get() == before + 1  # not a TLS refusal of ours
    finally:
        stop_all([server])


@pytest.mark.slow
def test_mutual_tls_refuses_a_client_without_a_certificate_of_the_ca(
    tmp_path: Path, pki: Path
) -> None:
    job, server = _server(tmp_path, pki, mutual=True, token=None)
    try:
        tls.configure(load_identity(pki, "ours", "client"))
        assert asyncio.run(_info(job, server.address, None)) == 0
        refused = tls.REFUSED._value.get()
        for identity in (
            load_identity(pki, "ours", None),  # no certificate
            tls.Tls(  # a certificate of another CA (trusting ours: it reaches the server)
                load_identity(pki, "ours", None).ca,
                (pki / "theirs" / "client.pem").read_bytes(),
                (pki / "theirs" / "client.key").read_bytes(),
            ),
            unchecked(load_identity(pki, "ours", None), pki, "expired"),  # ours, but expired
        ):
            tls.configure(identity)
            with pytest.raises(PeerUnavailable, match="TLS refused"):
                asyncio.run(_info(job, server.address, None))
        assert tls.REFUSED._value.get() == refused + 3
    finally:
        stop_all([server])


@pytest.mark.slow
def test_a_whole_swarm_trains_over_mutual_tls_with_the_token(tmp_path: Path, pki: Path) -> None:
    """Scheduler, embedded broker (mqtts), stage servers and the job API, every connection
    TLS with client certificates and the token: a job trains to its end and exports exactly
    what `swarm local` trains."""
    env = mutual_env(pki, "s3cret")
    job = write_job(tmp_path, training={"stages": 2, "steps": 6})
    sw, _ = start_local_swarm([1.0, 1.0, 1.0], log_dir=tmp_path, env=env)
    try:
        assert sw.broker.startswith("mqtts://")
        tls.configure(load_identity(pki, "ours", "client"))

        async def train() -> scheduler_pb2.JobStatus:
            async with SchedulerClient(sw.address, token="s3cret") as client:
                submitted = await client.submit(job)
                done = await asyncio.wait_for(client.wait(submitted.job, lambda _: None), 240)
                await client.export(done.job, tmp_path / "swarm.pt")
                return done

        done = asyncio.run(train())
        assert done.step == 6, (done.error, done.message)
        logs = sw.scheduler.log() + "".join(p.log() for p in sw.peers)
        assert "Traceback" not in logs, logs[-3000:]
    finally:
        sw.stop()
    assert_equal_to_local(job, torch.load(tmp_path / "swarm.pt"), tol=1e-9)


@pytest.mark.slow
def test_a_mutual_tls_scheduler_tells_clients_what_they_lack_and_logs_no_handshake_lines(
    tmp_path: Path, pki: Path
) -> None:
    """`swarm jobs` in clear text, then with the CA but no certificate, against a scheduler under
    --tls-mutual: each is told what to pass (not "Socket closed"), and the scheduler's log, at
    the default level, holds none of gRPC's raw handshake lines for them."""
    ours = pki / "ours"
    (tmp_path / "data").mkdir()
    tls_flags = ["--tls-ca", str(ours / "ca.pem")]
    server_flags = [*tls_flags, "--tls-cert", str(ours / "server.pem")]
    server_flags += ["--tls-key", str(ours / "server.key"), "--tls-mutual"]
    args = ["scheduler", "--port", "0", "--store", str(tmp_path / "jobs.sqlite")]
    args += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--data-root", str(tmp_path / "data")]
    # Not inherited from this process (which set it, importing swarm.flags): each process's own.
    environ = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    with mock.patch.dict(os.environ, environ, clear=True):
        scheduler = start_process([*args, *server_flags], log_dir=tmp_path, name="scheduler")
        try:
            scheduler.wait_ready(60)
            at = ("jobs", "--scheduler", scheduler.address)
            clear = swarm(*at, check=False)
            assert clear.returncode == 1
            assert "serves TLS with client certificates (--tls-mutual)" in clear.stderr
            assert "give --tls-ca" in clear.stderr and "--tls-cert and --tls-key" in clear.stderr
            bare = swarm(*at, *tls_flags, check=False)
            assert bare.returncode == 1
            assert "TLS refused" in bare.stderr and "requires a client certificate" in bare.stderr
            # The one error line on the client's terminal too.
            assert [clear.stderr.count("\n"), bare.stderr.count("\n")] == [1, 1], bare.stderr
            client = ["--tls-cert", str(ours / "client.pem"), "--tls-key", str(ours / "client.key")]
            assert "no jobs" in swarm(*at, *tls_flags, *client).stdout
        finally:
            stop_all([scheduler])
    log = scheduler.log()
    assert "Handshake failed" not in log and "ssl_transport_security" not in log, log[-3000:]
