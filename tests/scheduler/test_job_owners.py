"""Who may destroy a job (issue 44, N4): the job API on a real gRPC server with the swarm token,
over a real store. Only a job's submitter, or an admin, may cancel, delete or export it; every
holder of the swarm token still reads it; retention counts each submitter's finished jobs alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from client.sdk import ClientError, SchedulerClient
from scheduler.callers import Callers
from scheduler.retention import Retention
from swarm.job.states import TERMINAL_PROTO
from swarm.net.submitters import SUBMITTER_KEY, submitter_token
from swarm.proto import control_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.support.api import RunningApi, start_api
from tests.support.jobs import write_job
from tests.support.owners import ADMIN, ADMIN_TOKEN, ALICE, BOB, TOKEN, owned_api  # noqa: F401

pytestmark = pytest.mark.timeout(60)


def _client(api: RunningApi, submitter: str | None) -> SchedulerClient:
    return SchedulerClient(api.address, token=TOKEN, submitter_token=submitter, timeout_s=10.0)


async def _ended(client: SchedulerClient, job: str) -> None:
    for _ in range(500):
        if (await client.get(job)).state in TERMINAL_PROTO:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{job} did not end")


async def _refused(call: object, code: str = "PERMISSION_DENIED") -> str:
    with pytest.raises(ClientError) as e:
        await call  # type: ignore[misc]
    assert e.value.code == code, e.value
    return str(e.value)


@pytest.mark.attack("N4")
async def test_another_submitter_cannot_cancel_delete_or_export_a_job(
    api: RunningApi, tmp_path: Path
) -> None:
    async with _client(api, ALICE) as alice, _client(api, BOB) as bob:
        queued = (await alice.submit(write_job(tmp_path, "waiting"))).job
        done = (await alice.submit(write_job(tmp_path, "run"))).job  # FakeControl trains it
        await _ended(alice, done)
        status = await bob.get(queued)  # reading stays open to every token holder
        assert status.submitter == "alice"
        said = await _refused(bob.cancel(queued))
        assert "'alice'" in said and "'bob'" in said and "cancel" in said
        await _refused(bob.delete(done))
        await _refused(bob.export(done, tmp_path / "stolen.pt"))
        assert not (tmp_path / "stolen.pt").exists()
        # Nothing of alice's was touched: still queued, still stored, her files untouched.
        assert (await alice.get(queued)).state == control_pb2.JOB_STATE_QUEUED
        assert api.store.get(done) is not None
        assert api.control.cancelled_ids == [] and api.control.deleted_ids == []
        # Her own calls pass.
        assert await alice.export(done, tmp_path / "mine.pt") == 7


@pytest.mark.attack("N4")
async def test_the_swarm_token_alone_cannot_act_on_a_named_submitters_job(
    api: RunningApi, tmp_path: Path
) -> None:
    async with _client(api, ALICE) as alice, _client(api, None) as anonymous:
        job = (await alice.submit(write_job(tmp_path, "waiting"))).job
        await _refused(anonymous.cancel(job))
        # And its own jobs are its own: submitted with the token alone, cancelled the same way.
        own = (await anonymous.submit(write_job(tmp_path, "mine"))).job
        assert (await anonymous.get(own)).submitter == ""
        await anonymous.cancel(own)
        await _refused(alice.cancel(own))  # nor is a named submitter anyone's admin


async def test_an_admin_may_cancel_delete_and_export_every_job(
    api: RunningApi, tmp_path: Path
) -> None:
    async with _client(api, ALICE) as alice, _client(api, ADMIN) as admin:
        queued = (await alice.submit(write_job(tmp_path, "waiting"))).job
        done = (await alice.submit(write_job(tmp_path, "run"))).job
        await _ended(alice, done)
        assert await admin.export(done, tmp_path / "admin.pt") == 7
        await admin.cancel(queued)
        await admin.delete(done)
        assert api.store.get(done) is None and api.control.deleted_ids == [done]
        assert api.control.cancelled_ids == [queued]
        own = (await admin.submit(write_job(tmp_path, "admins"))).job
        assert (await alice.get(own)).submitter == "admin"


@pytest.mark.attack("L-admin")
async def test_the_admin_token_itself_is_no_credential(api: RunningApi, tmp_path: Path) -> None:
    # Issue 54: the admin token was itself the admin's bearer credential, so the root of every
    # submitter token travelled on the wire (in clear without TLS), and whoever saw it made
    # any submitter's token. Now the admin sends a credential made from it, as submitters do.
    assert ADMIN_TOKEN not in ADMIN
    async with _client(api, ADMIN_TOKEN) as root, _client(api, ALICE) as alice:
        said = await _refused(root.submit(write_job(tmp_path, "x")), "UNAUTHENTICATED")
        assert "swarm submitter-token admin" in said
        job = (await alice.submit(write_job(tmp_path, "y"))).job
        await _refused(root.cancel(job), "UNAUTHENTICATED")
    assert [r.submitter for r in api.store.list()] == ["alice"]


async def test_a_forged_submitter_token_is_refused_not_taken_as_anonymous(
    api: RunningApi, tmp_path: Path
) -> None:
    forged = submitter_token("another-admin-token", "alice")  # right form, wrong secret
    for token in (forged, "alice:" + "0" * 64, "alice", ""):
        if not token:
            continue
        async with _client(api, token) as mallory:
            said = await _refused(mallory.submit(write_job(tmp_path, "x")), "UNAUTHENTICATED")
            assert "submitter token" in said
    # Two values of the key: refused too (which one would count?).
    path = write_job(tmp_path, "x")
    request = scheduler_pb2.SchedulerSubmitJobRequest(
        spec=path.read_text(), base_dir=str(path.parent)
    )
    two = (("authorization", f"Bearer {TOKEN}"), (SUBMITTER_KEY, ALICE), (SUBMITTER_KEY, BOB))
    async with grpc.aio.insecure_channel(api.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.SubmitJob(request, metadata=two)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert api.store.list() == []


async def test_a_scheduler_without_an_admin_token_refuses_submitter_tokens(
    tmp_path: Path,
) -> None:
    running = await start_api(tmp_path, token=TOKEN, callers=Callers(None, mutual=False))
    try:
        async with _client(running, ALICE) as alice:
            said = await _refused(alice.submit(write_job(tmp_path, "x")), "UNAUTHENTICATED")
            assert "--admin-token-file" in said
    finally:
        await running.stop()


@pytest.mark.attack("N4")
async def test_retention_counts_each_submitters_finished_jobs_alone(
    api: RunningApi, tmp_path: Path
) -> None:
    """B submits and cancels N jobs under --keep-finished-jobs N: only B's own older jobs go."""
    keep = 3
    async with _client(api, ALICE) as alice, _client(api, BOB) as bob:
        hers = (await alice.submit(write_job(tmp_path, "run"))).job
        await _ended(alice, hers)
        his_old = (await bob.submit(write_job(tmp_path, "old"))).job
        await bob.cancel(his_old)
        his = [(await bob.submit(write_job(tmp_path, f"b{i}"))).job for i in range(keep)]
        for job in his:
            await bob.cancel(job)

    async def delete(job_id: str) -> None:
        pass

    await Retention(api.store, keep, shutting_down=lambda _: False, delete=delete).sweep()
    assert {r.id for r in api.store.list()} == {hers, *his}  # bob's oldest went, alice's stayed
