"""A submission makes one job however many times it is asked (the job API on a real gRPC server,
over a real store): each `swarm submit` sends a request id of its own, asks again with it where
the answer was lost (the scheduler may have taken the job), and the scheduler answers a request
id it has seen from the same submitter with the job it made then. Before, a lost answer read as
a failure, and submitting again (by hand, or by a script's retry) made a second job of the same
file, training beside the first on the same peers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from client.sdk import SchedulerClient
from scheduler.job_api import MAX_REQUEST_ID_CHARS, JobApiServicer
from scheduler.store import JobStore
from swarm.net.submitters import SUBMITTER_KEY
from swarm.proto import scheduler_pb2, scheduler_pb2_grpc
from tests.support.api import RunningApi, start_api
from tests.support.jobs import BASE, render, write_job
from tests.support.owners import ADMIN, ALICE, BOB, TOKEN, owned_api  # noqa: F401
from tests.support.store_schema import as_before

pytestmark = pytest.mark.timeout(60)


async def _submit(api: RunningApi, request_id: str, submitter: str | None) -> Any:
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    metadata += ((SUBMITTER_KEY, submitter),) if submitter else ()
    async with grpc.aio.insecure_channel(api.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        request = scheduler_pb2.SchedulerSubmitJobRequest(
            spec=render(BASE), base_dir="/", request_id=request_id
        )
        return await stub.SubmitJob(request, timeout=10, metadata=metadata)


async def test_a_request_id_asked_again_answers_the_job_it_made(api: RunningApi) -> None:
    first = (await _submit(api, "r-1", ALICE)).job
    again = (await _submit(api, "r-1", ALICE)).job
    assert again.job == first.job and len(api.store.list()) == 1
    assert api.control.submitted_ids == [first.job], "the job was started once"
    # another submitter's id is theirs alone; another id, or none, is another submission
    bobs = (await _submit(api, "r-1", BOB)).job
    other = (await _submit(api, "r-2", ALICE)).job
    none_1, none_2 = (await _submit(api, "", ALICE)).job, (await _submit(api, "", ALICE)).job
    made = {first.job, bobs.job, other.job, none_1.job, none_2.job}
    assert len(made) == 5 and len(api.store.list()) == 5


async def test_a_request_id_past_its_bound_is_refused(api: RunningApi) -> None:
    for bad in ("x" * (MAX_REQUEST_ID_CHARS + 1), "a b", "é"):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _submit(api, bad, ALICE)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert "request_id" in (e.value.details() or "")
    assert api.store.list() == []


async def _late(context: Any) -> None:
    await asyncio.sleep(3)  # past the client's 1 s deadline: the answer does not come in time


async def _broken(context: Any) -> None:
    await context.abort(grpc.StatusCode.UNAVAILABLE, "Connection reset by peer")


@pytest.mark.parametrize("lose", [_late, _broken], ids=["late", "broken"])
async def test_a_submission_whose_answer_was_lost_is_asked_again_and_makes_one_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lose: Callable[[Any], Awaitable[None]]
) -> None:
    """The scheduler takes the job, and its answer is lost: it does not come back within the
    client's deadline (a slow link, a scheduler busy hashing another's data), or the connection
    breaks after the job was made (UNAVAILABLE: a restart, a router that dropped it). The client
    asks again with the same request id and gets the job made the first time."""
    original = JobApiServicer.SubmitJob
    asked: list[str] = []

    async def lost_once(self: JobApiServicer, request: Any, context: Any) -> Any:
        answer = await original(self, request, context)
        asked.append(request.request_id)
        if len(asked) == 1:
            await lose(context)
        return answer

    monkeypatch.setattr(JobApiServicer, "SubmitJob", lost_once)
    api = await start_api(tmp_path)
    try:
        async with SchedulerClient(api.address, timeout_s=1.0) as client:
            status = await client.submit(write_job(tmp_path, "once"))
        assert [r.id for r in api.store.list()] == [status.job]
        assert len(asked) == 2 and asked[0] == asked[1] != "", asked
    finally:
        await api.stop()


def test_a_store_of_the_schema_before_gains_the_requests(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    with JobStore(path) as store:
        old = store.create("j", "spec", "/data", 9).id
    as_before(path, 6)  # as a swarm before request ids left it
    with JobStore(path) as store:
        made = store.create("k", "spec", "/data", 9, "alice", "r-1").id
        assert store.by_request("alice", "r-1") == store.get(made)
        assert store.by_request("bob", "r-1") is None and store.get(old) is not None
        store.set_state(made, "cancelled")
        store.delete(made)  # its request goes with it
        assert store.by_request("alice", "r-1") is None
