"""A replica's worker runs an audit's re-execution ahead of the calls queued in turn
(`Worker.run_ahead`, issue 69) where the audit still gates its microbatch's report: the step
waits for it before it commits, and a re-execution queued behind the auditor's pushes made it wait
for those pushes too. A late audit's (its microbatch reported already, `client.audit.late_audits`)
has a step to end in: it runs in turn, so it does not hold up the pushes of the step being trained.
The calls queued in turn keep their order; a caller that gives up, or a worker whose executor is
shut down with calls queued, leaves nothing waiting."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stage_server.peer.limits import PeerLimits
from stage_server.peer.metrics import StageMetrics
from stage_server.replica.answering import Answering
from stage_server.replica.messages import Limits, Messages
from stage_server.replica.runtime import StageRuntime
from stage_server.replica.worker import AHEAD_IN_A_ROW, Worker
from swarm.proto import stage_pb2 as pb
from tests.support.jobs import make_job


def _itself(x: str) -> str:
    return x


def _recorded(ran: list[str]) -> Callable[[str], str]:
    """A call that notes its name in `ran` as it runs (on the worker thread)."""

    def call(name: str) -> str:
        ran.append(name)
        return name

    return call


async def _held(worker: Worker, release: threading.Event) -> asyncio.Task[tuple[str, float]]:
    """A call that holds the worker until `release` is set, started."""
    started = threading.Event()

    def hold() -> str:
        started.set()
        release.wait()
        return "held"

    holding = asyncio.create_task(worker.run_then(hold, _itself))
    await asyncio.to_thread(started.wait)  # the worker is busy: whatever comes next queues
    return holding


@contextlib.asynccontextmanager
async def _busy() -> AsyncIterator[tuple[Worker, threading.Event, asyncio.Task[tuple[str, float]]]]:
    """A worker on a thread of its own, held by a call until the event is set: whatever is
    asked of it meanwhile queues."""
    with ThreadPoolExecutor(1) as pool:
        worker = Worker(pool, lambda _: None)
        release = threading.Event()
        yield worker, release, await _held(worker, release)


async def test_a_reexecution_queued_behind_pushes_runs_before_them() -> None:
    ran: list[str] = []
    call = _recorded(ran)
    async with _busy() as (worker, release, holding):
        pushes = [
            asyncio.create_task(worker.run_then(call, _itself, f"push {i}")) for i in range(3)
        ]
        await asyncio.sleep(0)  # the pushes are queued before the re-execution is asked
        audit = asyncio.create_task(worker.run_ahead(call, _itself, "re-execution"))
        await asyncio.sleep(0)
        release.set()
        answers = await asyncio.gather(holding, *pushes, audit)
    assert ran == ["re-execution", "push 0", "push 1", "push 2"]
    assert [a for a, _ in answers] == ["held", "push 0", "push 1", "push 2", "re-execution"]
    assert worker.waiting == 0


async def test_a_stream_of_calls_asked_ahead_does_not_hold_the_pushes_back() -> None:
    # A review's repro: on the push plane any token holder's Forward is taken for an audit's
    # re-execution and asked ahead; a stream of them ran before every push for as long as it
    # went on. Past `AHEAD_IN_A_ROW` in a row, the call in turn that waits runs.
    ran: list[str] = []
    call = _recorded(ran)
    async with _busy() as (worker, release, holding):
        push = asyncio.create_task(worker.run_then(call, _itself, "push"))
        await asyncio.sleep(0)
        flood = [
            asyncio.create_task(worker.run_ahead(call, _itself, f"ahead {i}")) for i in range(6)
        ]
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(holding, push, *flood)
    assert ran.index("push") == AHEAD_IN_A_ROW, ran


async def test_a_call_whose_caller_gave_up_while_queued_is_not_run() -> None:
    ran: list[str] = []
    call = _recorded(ran)
    async with _busy() as (worker, release, holding):
        gone = asyncio.create_task(worker.run_then(call, _itself, "gone"))
        kept = asyncio.create_task(worker.run_then(call, _itself, "kept"))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone  # given up while the worker is still held
        release.set()
        await asyncio.gather(holding, kept)
    assert ran == ["kept"]


async def test_calls_queued_when_the_executor_shuts_down_are_cancelled_not_left_waiting() -> None:
    pool = ThreadPoolExecutor(1)
    worker = Worker(pool, lambda _: None)
    release = threading.Event()
    holding = await _held(worker, release)
    queued = [asyncio.create_task(worker.run_ahead(_itself, _itself, "x")) for _ in range(2)]
    await asyncio.sleep(0)
    worker.close()
    pool.shutdown(wait=False, cancel_futures=True)  # as a stopping stage server does
    release.set()
    await holding
    done = await asyncio.wait_for(asyncio.gather(*queued, return_exceptions=True), 30)
    assert all(isinstance(d, asyncio.CancelledError) for d in done)
    assert worker.waiting == 0


def _answering(tmp_path: Path, plane: str, worker: Worker) -> Answering:
    job = make_job(tmp_path, runtime={"data_plane": plane})
    runtime = StageRuntime(job, 0)
    return Answering(
        peer="p",
        worker=worker,
        messages=Messages(Limits(PeerLimits()), StageMetrics("p")),
        runtime=lambda: runtime,
    )


async def _placed(
    answering: Answering, h: object, call: Callable[[str], str], name: str
) -> tuple[str, float]:
    """`call(name)` on the worker, placed there as the call of header `h` is."""
    return await answering.run(h)(call, _itself, name)


async def test_a_late_reexecution_queues_behind_the_pushes_and_a_gating_one_runs_before_them(
    tmp_path: Path,
) -> None:
    """On the push plane, as the auditor's `Answering` places them: the pushes queued keep their
    turn before a late audit's re-execution (its deadline a step away), and one whose audit
    gates its microbatch's report (the job's last step, `delayed_update`, bf16-mixed:
    `PushAudits.defers`) still runs before them."""
    ran: list[str] = []
    call = _recorded(ran)
    with ThreadPoolExecutor(1) as pool:
        worker = Worker(pool, lambda _: None)
        answering = _answering(tmp_path, "push", worker)
        release = threading.Event()
        holding = await _held(worker, release)
        asked = []
        for name, h in (
            ("push 0", pb.StagePushRequest()),
            ("push 1", pb.StagePushRequest()),
            ("late", pb.StageBackwardRequest(late=True)),
            ("gating", pb.StageForwardRequest()),
            ("push 2", pb.StagePushRequest()),
        ):
            asked.append(asyncio.create_task(_placed(answering, h, call, name)))
            await asyncio.sleep(0)  # queued in this order, each before the next is asked
        release.set()
        await asyncio.gather(holding, *asked)
    assert ran == ["gating", "push 0", "push 1", "late", "push 2"]
    assert worker.waiting == 0


@pytest.mark.parametrize("plane", ["push", "relay"])
async def test_on_the_push_plane_a_call_outside_a_push_is_a_reexecution(
    tmp_path: Path, plane: str
) -> None:
    """The push plane trains and evaluates through Push alone: there a Forward, Backward or
    ForwardBackward that does not evaluate is an audit's re-execution, run ahead. On the relay
    plane (`client.data_plane.carry`) they are its training, run in turn."""
    with ThreadPoolExecutor(1) as pool:
        worker = Worker(pool, lambda _: None)
        answering = _answering(tmp_path, plane, worker)
        ahead = worker.run_ahead if plane == "push" else worker.run_then
        assert answering.run(pb.StageForwardRequest()) == ahead
        assert answering.run(pb.StageBackwardRequest()) == ahead
        assert answering.run(pb.StageForwardBackwardRequest()) == ahead
        assert answering.run(pb.StageForwardRequest(evaluate=True)) == worker.run_then
        assert answering.run(pb.StageForwardBackwardRequest(evaluate=True)) == worker.run_then
        assert answering.run(pb.StagePushRequest()) == worker.run_then
        # a late audit's (`client.audit.late_audits`): in turn, on either plane
        assert answering.run(pb.StageForwardRequest(late=True)) == worker.run_then
        assert answering.run(pb.StageBackwardRequest(late=True)) == worker.run_then
        assert answering.run(pb.StageForwardBackwardRequest(late=True)) == worker.run_then
