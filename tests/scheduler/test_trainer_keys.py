"""A trainer id is its first caller's (`scheduler.trainer_keys`): a call under it with another key
is refused before the coordinator hears it. Before, any token holder naming a trainer's id renewed
that trainer's leases, or gave them back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from scheduler import trainer_keys
from scheduler.store import JobStore
from scheduler.trainer_calls import TrainerCalls
from scheduler.trainer_keys import FORGET_S, KEEP_S, TrainerKeys, embedded_trainer
from swarm.errors import InvalidArgument, PermissionDenied, ResourceExhausted
from swarm.proto import scheduler_pb2 as spb
from swarm.proto import scheduler_pb2_grpc
from swarm.rpc.lease import Lease
from tests.support.api import start_api
from tests.support.jobs import BASE, render

pytestmark = [pytest.mark.timeout(60), pytest.mark.attack("trainer-word")]

MINE, THEIRS = b"k" * 32, b"x" * 32


async def test_another_callers_trainer_id_is_refused(tmp_path: Path) -> None:
    with JobStore(tmp_path / "jobs.db") as store:
        job = store.create("test", render(BASE), str(tmp_path), 3).id
    heard: list[tuple[str, str]] = []

    async def lease(job: str, trainer: str, count: int, **_: Any) -> Lease:
        heard.append(("lease", trainer))
        return Lease(0, [], [])

    async def report(job: str, trainer: str, results: Any, released: Any, failure: Any) -> None:
        heard.append(("report", trainer))

    api = await start_api(tmp_path)
    api.control.lease, api.control.report = lease, report  # type: ignore[attr-defined]
    try:
        async with grpc.aio.insecure_channel(api.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            mine = spb.SchedulerLeaseMicrobatchesRequest(job=job, trainer="t", trainer_key=MINE)
            await stub.LeaseMicrobatches(mine, timeout=30)
            # Another caller under "t": its renewals, and its giving back "t"'s leases.
            theirs = spb.SchedulerLeaseMicrobatchesRequest(
                job=job, trainer="t", trainer_key=THEIRS, working=[spb.MicrobatchRef(index=0)]
            )
            release = spb.SchedulerReportMicrobatchesRequest(
                job=job, trainer="t", released=[0], trainer_key=THEIRS
            )
            for call, request in (
                (stub.LeaseMicrobatches, theirs),
                (stub.ReportMicrobatches, release),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call(request, timeout=30)
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value.details()
                assert "another caller's" in (e.value.details() or "")
            # A report's `next` under another's id, with the reporter's own key: refused whole.
            sneaked = spb.SchedulerReportMicrobatchesRequest(
                job=job,
                trainer="u",
                trainer_key=THEIRS,
                next=spb.SchedulerLeaseMicrobatchesRequest(job=job, trainer="t"),
            )
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.ReportMicrobatches(sneaked, timeout=30)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            # The scheduler's own trainer calls the coordinator in-process: its id is no one's.
            embedded = spb.SchedulerReportMicrobatchesRequest(
                job=job, trainer=embedded_trainer(job), released=[0], trainer_key=MINE
            )
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.ReportMicrobatches(embedded, timeout=30)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            keyless = spb.SchedulerLeaseMicrobatchesRequest(job=job, trainer="v")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.LeaseMicrobatches(keyless, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            await stub.LeaseMicrobatches(mine, timeout=30)  # its own go on
    finally:
        await api.stop()
    assert heard == [("lease", "t"), ("lease", "t")], heard


def test_an_id_unheard_past_any_lease_is_forgotten() -> None:
    now = [0.0]
    keys = TrainerKeys(clock=lambda: now[0])
    keys.check("j", "t", MINE)
    now[0] = FORGET_S - 1  # heard within: still its first caller's
    with pytest.raises(PermissionDenied):
        keys.check("j", "t", THEIRS)
    keys.check("j", "t", MINE)
    now[0] += FORGET_S + 1  # no lease outlives this: the id is free
    keys.check("j", "t", THEIRS)
    keys.check("k", "t", MINE)  # another job's "t" is another id


def test_past_the_bound_the_id_heard_least_recently_makes_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One caller registering `MAX_TRAINERS` ids an hour (18 calls a second) refused every new
    trainer of every job. Past the bound, the id heard from least recently is forgotten, if not
    within `KEEP_S` (a trainer calls far more often: its binding is never taken from it while
    it works); its own caller's next call binds it again. A flood of new ids faster than that
    is refused, and said so."""
    monkeypatch.setattr(trainer_keys, "MAX_TRAINERS", 2)
    now = [0.0]
    keys = TrainerKeys(clock=lambda: now[0])
    keys.check("j", "a", MINE)
    keys.check("j", "b", THEIRS)
    now[0] = KEEP_S + 1
    keys.check("j", "b", THEIRS)  # b works on; a is silent
    keys.check("k", "new", MINE)  # before: refused ("MAX_TRAINERS ids were heard ...")
    with pytest.raises(PermissionDenied):
        keys.check("j", "b", MINE)  # b kept its binding
    now[0] += 1
    with pytest.raises(ResourceExhausted, match="within"):
        keys.check("j", "c", MINE)  # every id heard within KEEP_S: a flood, refused
    now[0] += KEEP_S
    keys.check("j", "a", MINE)  # a's caller back: bound anew, in the place of b, silent since


def test_a_reports_next_lease_is_of_its_own_job() -> None:
    """The job API checks a report's job, not its `next` lease's: a next lease naming a job of
    megabytes (or any made-up one) was bound under its trainer id for an hour, a new id a call
    (`MAX_TRAINERS` of them, each as large), before the lease was refused as of no job."""
    calls = TrainerCalls()
    request = spb.SchedulerReportMicrobatchesRequest(
        job="j",
        trainer="u",
        trainer_key=MINE,
        next=spb.SchedulerLeaseMicrobatchesRequest(job="x" * 1_000_000, trainer="v"),
    )
    with pytest.raises(InvalidArgument, match="its own job"):
        calls.report(request)
    assert not calls.keys._held
    request.next.job = "j"
    calls.report(request)
    assert set(calls.keys._held) == {("j", "u"), ("j", "v")}
