"""Under --tls-mutual a caller of the job API is its client certificate's name (issue 44, N4),
with nothing else to configure: a real gRPC server over TLS requiring client certificates of the
swarm's CA, and clients each with their own certificate."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from scheduler.callers import Callers
from scheduler.job_api import JobApiServicer
from scheduler.store import JobStore
from swarm.net import tls
from swarm.net.certs import issue
from swarm.net.submitters import SUBMITTER_KEY, submitter_token
from swarm.net.tokens import add_port
from swarm.proto import control_pb2, scheduler_pb2, scheduler_pb2_grpc
from swarm.rpc.lease import lease_from_proto, lease_request
from swarm.rpc.server_options import SCHEDULER_LIMITS, grpc_server
from tests.support.api import AUDITED, FakeControl
from tests.support.jobs import write_job
from tests.support.tls import HOSTS, load_identity, no_identity, pki

__all__ = ["no_identity", "pki"]  # fixtures

TOKEN = "swarm-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
ADMIN_TOKEN = "admin-token-of-the-scheduler"

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def address(pki: Path, tmp_path: Path) -> AsyncIterator[str]:
    """The job API over mutual TLS (the process's identity: the swarm's `server` certificate)."""
    for name in ("alice", "bob", "scheduler"):
        issue(pki / "ours", name, HOSTS)
    tls.configure(load_identity(pki, "ours", "server", mutual=True))
    store = JobStore(tmp_path / "jobs.db")
    server = grpc_server(SCHEDULER_LIMITS, token=TOKEN, registry=CollectorRegistry())
    control: Any = FakeControl(store)  # trains nothing; not under test
    callers = Callers(ADMIN_TOKEN)
    servicer = JobApiServicer(store, control, data_root=tmp_path / "data", callers=callers)
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
    port = add_port(server, "127.0.0.1:0", "the scheduler")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)
    store.close()


def _stub(pki: Path, name: str, address: str) -> tuple[grpc.aio.Channel, object]:
    ours = pki / "ours"
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(ours / "ca.pem").read_bytes(),
        private_key=(ours / f"{name}.key").read_bytes(),
        certificate_chain=(ours / f"{name}.pem").read_bytes(),
    )
    channel = grpc.aio.secure_channel(address, credentials)
    return channel, scheduler_pb2_grpc.SchedulerServiceStub(channel)


def _submit(tmp_path: Path) -> scheduler_pb2.SchedulerSubmitJobRequest:
    path = write_job(tmp_path, "waiting")
    return scheduler_pb2.SchedulerSubmitJobRequest(spec=path.read_text(), base_dir=str(path.parent))


@pytest.mark.attack("N4")
async def test_a_certificate_names_its_caller_and_the_schedulers_is_an_admin(
    pki: Path, address: str, tmp_path: Path
) -> None:
    submit = _submit(tmp_path)
    a, alice = _stub(pki, "alice", address)
    b, bob = _stub(pki, "bob", address)
    s, scheduler = _stub(pki, "scheduler", address)
    try:
        job = (await alice.SubmitJob(submit, metadata=AUTH)).job  # type: ignore[attr-defined]
        assert job.submitter == "cert:alice"  # a certificate's name, no token's (issue 54)
        cancel = scheduler_pb2.SchedulerCancelJobRequest(job=job.job)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await bob.CancelJob(cancel, metadata=AUTH)  # type: ignore[attr-defined]
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "'cert:alice'" in (e.value.details() or "")
        # The scheduler's own certificate: its holder holds the store anyway.
        done = await scheduler.CancelJob(cancel, metadata=AUTH)  # type: ignore[attr-defined]
        assert done.job.state == control_pb2.JOB_STATE_CANCELLED
    finally:
        for channel in (a, b, s):
            await channel.close()


@pytest.mark.attack("L-names")
async def test_a_certificate_named_as_a_submitter_is_not_that_submitter(
    pki: Path, address: str, tmp_path: Path
) -> None:
    # Issue 54: certificate names and submitter-token names were one namespace, so a host's
    # certificate whose name was a submitter's (a stage server's "alice") managed that
    # submitter's jobs. Now a certificate speaks as cert:NAME, which no token can name.
    submit = _submit(tmp_path)
    a, host = _stub(pki, "alice", address)  # a host certificate that happens to say "alice"
    as_alice = (*AUTH, (SUBMITTER_KEY, submitter_token(ADMIN_TOKEN, "alice")))
    try:
        job = (await host.SubmitJob(submit, metadata=as_alice)).job  # type: ignore[attr-defined]
        assert job.submitter == "alice"  # the token's, sent beside the certificate
        cancel = scheduler_pb2.SchedulerCancelJobRequest(job=job.job)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await host.CancelJob(cancel, metadata=AUTH)  # type: ignore[attr-defined]
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        done = await host.CancelJob(cancel, metadata=as_alice)  # type: ignore[attr-defined]
        assert done.job.state == control_pb2.JOB_STATE_CANCELLED
    finally:
        await a.close()


@pytest.mark.attack("audit-seeds")
async def test_a_certificate_that_may_not_manage_a_job_leases_it_without_its_audits(
    pki: Path, address: str, tmp_path: Path
) -> None:
    """A trainer under --tls-mutual is its certificate's name: another host's is told no
    contribution audit of a job of cert:alice's; hers and the scheduler's are."""
    a, alice = _stub(pki, "alice", address)
    b, bob = _stub(pki, "bob", address)
    s, scheduler = _stub(pki, "scheduler", address)
    try:
        submitted = alice.SubmitJob(_submit(tmp_path), metadata=AUTH)  # type: ignore[attr-defined]
        job = (await submitted).job
        told = {}
        for name, stub in (("alice", alice), ("bob", bob), ("scheduler", scheduler)):
            request = lease_request(job.job, f"trainer-{name}", 1, 0.0, ())
            request.trainer_key = name.encode().ljust(32, b".")
            leasing = stub.LeaseMicrobatches(request, metadata=AUTH)  # type: ignore[attr-defined]
            told[name] = [t.audits for t in lease_from_proto(await leasing).tasks]
        assert told == {"alice": [(AUDITED,)], "bob": [()], "scheduler": [(AUDITED,)]}
    finally:
        for channel in (a, b, s):
            await channel.close()
