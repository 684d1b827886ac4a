"""A trainer's calls to the job API are bounded where they enter it: its id (kept for a minute
by the coordinator's shares, and in every lease) is at most `MAX_TRAINER_ID_CHARS`, and a lease
or report names at most `MAX_REPORTED` microbatches in each of its lists. Any token holder may
call them as a trainer: 200,000 results in one 2.6 MB report held the scheduler's event loop
1.5 s in their conversion alone, before the coordinator read one, and ids of megabytes were kept
by the thousand. A real gRPC server over a real store; the coordinator stands in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from scheduler.store import JobStore
from scheduler.trainer_calls import MAX_REPORT_ENTRIES, MAX_REPORTED, MAX_TRAINER_ID_CHARS
from swarm.proto import scheduler_pb2 as spb
from swarm.proto import scheduler_pb2_grpc
from tests.support.api import start_api
from tests.support.jobs import BASE, render

pytestmark = pytest.mark.timeout(60)


async def test_a_trainers_id_and_lists_past_their_bounds_are_refused(tmp_path: Path) -> None:
    with JobStore(tmp_path / "jobs.db") as store:
        job = store.create("test", render(BASE), str(tmp_path), 3).id
    reported: list[int] = []

    async def report(job: str, trainer: str, results: Any, released: Any, failure: Any) -> None:
        reported.append(len(results))

    api = await start_api(tmp_path)
    api.control.report = report  # type: ignore[attr-defined]
    many = [spb.MicrobatchReport(step=0, index=i, samples=4) for i in range(MAX_REPORTED + 1)]
    refs = [spb.MicrobatchRef(step=0, index=i) for i in range(MAX_REPORTED + 1)]
    # one result whose inner lists hold more than any result's: 2M empty digests in one report
    # were 2M objects made on the event loop, seconds of it
    swollen = spb.MicrobatchReport(step=0, index=0, samples=4)
    swollen.digests.extend(spb.GradientDigest() for _ in range(MAX_REPORT_ENTRIES + 1))
    calls = [
        spb.SchedulerReportMicrobatchesRequest(job=job, trainer="t", results=[swollen]),
        spb.SchedulerReportMicrobatchesRequest(job=job, trainer="t", results=many),
        spb.SchedulerReportMicrobatchesRequest(job=job, trainer="t", released=range(len(refs))),
        spb.SchedulerReportMicrobatchesRequest(
            job=job, trainer="x" * (MAX_TRAINER_ID_CHARS + 1), results=many[:1]
        ),
        spb.SchedulerReportMicrobatchesRequest(
            job=job,
            trainer="t",
            results=many[:1],
            next=spb.SchedulerLeaseMicrobatchesRequest(job=job, trainer="t", working=refs),
        ),
    ]
    try:
        async with grpc.aio.insecure_channel(api.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.ReportMicrobatches(call, timeout=30)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            lease = spb.SchedulerLeaseMicrobatchesRequest(
                job=job, trainer="y" * (MAX_TRAINER_ID_CHARS + 1)
            )
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.LeaseMicrobatches(lease, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert "trainer" in (e.value.details() or "")
            # within the bounds: taken
            within = spb.SchedulerReportMicrobatchesRequest(
                job=job, trainer="t", results=many[:-1], trainer_key=bytes(32)
            )
            await stub.ReportMicrobatches(within, timeout=30)
    finally:
        await api.stop()
    assert reported == [MAX_REPORTED], "nothing past a bound reached the coordinator"


def test_a_window_past_what_a_report_may_name_is_refused_at_load(tmp_path: Path) -> None:
    from swarm.errors import ConfigError
    from tests.support.jobs import make_job

    assert make_job(tmp_path, runtime={"max_in_flight": MAX_REPORTED}).runtime.max_in_flight
    with pytest.raises(ConfigError, match="max_in_flight"):
        make_job(tmp_path, runtime={"max_in_flight": MAX_REPORTED + 1})
