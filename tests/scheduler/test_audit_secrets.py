"""Who is told a step's contribution audits (docs/decisions.md, "A step's audits are told only
to the job's own trainers"): the job API on a real gRPC server, with named submitters. Any
swarm-token holder may lease a job's microbatches, and a replica's operator may run a trainer;
the audits' draws and seeds must not reach it before its replica sends its contribution, or it
sends an honest one exactly when drawn (and, knowing q, a wrong one that passes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from client.remote import RemoteCoordinator
from client.sdk import SchedulerClient
from swarm.net import dial
from swarm.net.submitters import SUBMITTER_KEY
from swarm.proto import scheduler_pb2 as spb
from swarm.proto import scheduler_pb2_grpc
from swarm.rpc.lease import Lease, lease_from_proto, lease_request
from tests.support.api import AUDITED, RunningApi
from tests.support.jobs import write_job
from tests.support.owners import ADMIN, ALICE, BOB, TOKEN, owned_api  # noqa: F401

pytestmark = pytest.mark.timeout(60)


async def _job(api: RunningApi, tmp_path: Path, submitter: str | None) -> str:
    """A job submitted by `submitter` (None: the swarm token alone)."""
    async with SchedulerClient(
        api.address, token=TOKEN, submitter_token=submitter, timeout_s=10.0
    ) as client:
        return (await client.submit(write_job(tmp_path, "waiting"))).job


async def _leases(api: RunningApi, job: str, submitter: str | None) -> list[Lease]:
    """A lease, and a report's next lease, as a trainer calling with `submitter`'s token gets
    them (None: the swarm token alone)."""
    metadata = ((SUBMITTER_KEY, submitter),) if submitter else None
    channel = dial.channel(api.address, token=TOKEN)
    try:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        request = lease_request(job, "trainer-x", 1, 0.0, ())
        request.trainer_key = b"k" * 32
        leased = await stub.LeaseMicrobatches(request, metadata=metadata, timeout=10)
        report = spb.SchedulerReportMicrobatchesRequest(
            job=job, trainer="trainer-x", trainer_key=b"k" * 32, next=request
        )
        reported = await stub.ReportMicrobatches(report, metadata=metadata, timeout=10)
        return [lease_from_proto(leased), lease_from_proto(reported.lease)]
    finally:
        await channel.close()


def _audits(leases: list[Lease]) -> list[tuple[object, ...]]:
    return [task.audits for lease in leases for task in lease.tasks]


@pytest.mark.attack("audit-seeds")
async def test_a_lessee_that_may_not_manage_the_job_is_told_no_audit(
    api: RunningApi, tmp_path: Path
) -> None:
    job = await _job(api, tmp_path, ALICE)
    for outsider in (BOB, None):  # another submitter; the swarm token alone
        leases = await _leases(api, job, outsider)
        assert [len(lease.tasks) for lease in leases] == [1, 1]  # it trains the job all the same
        assert _audits(leases) == [(), ()]
    for own in (ALICE, ADMIN):  # its submitter, an admin: the job's own trainers
        assert _audits(await _leases(api, job, own)) == [(AUDITED,), (AUDITED,)]


async def test_a_job_of_the_swarm_token_alone_tells_every_token_holder(
    api: RunningApi, tmp_path: Path
) -> None:
    """Where a job was submitted with the swarm token alone, every holder of it is its
    submitter (it may cancel the job too): all its trainers are its own."""
    job = await _job(api, tmp_path, None)
    assert _audits(await _leases(api, job, None)) == [(AUDITED,), (AUDITED,)]


async def test_a_remote_trainer_with_its_submitter_token_is_told_the_audits(
    api: RunningApi, tmp_path: Path
) -> None:
    job = await _job(api, tmp_path, ALICE)
    own = RemoteCoordinator(api.address, job, token=TOKEN, submitter_token=ALICE)
    other = RemoteCoordinator(api.address, job, token=TOKEN)
    try:
        assert _audits([await own.lease("t-own", 1)]) == [(AUDITED,)]
        assert _audits([await own.report_and_lease("t-own", [], 1, working=())]) == [(AUDITED,)]
        assert _audits([await other.lease("t-other", 1)]) == [()]
    finally:
        await own.close()
        await other.close()
