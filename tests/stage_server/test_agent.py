"""A peer's agent against forged control messages (issue 27, item 5): one message on the bus,
published by anyone who may publish there, must not disable a peer until it restarts."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from stage_server.agent import REFUSED_RETRY_S, PeerAgent
from swarm.bus.topics import Topics
from swarm.clock import FakeClock
from swarm.device.oom import out_of_memory
from swarm.job.config import JobConfig, parse_job
from swarm.proto import control_pb2 as cpb
from swarm.rpc.cache_room import drop_unused_items, hold
from tests.support.jobs import BASE, render
from tests.support.waiting import wait_until


class _Bus:
    topics = Topics()

    async def publish(self, topic: str, message: Any, retain: bool = False) -> None:
        pass


class _Servicer:
    def __init__(self) -> None:
        self.served: list[tuple[str, int]] = []
        self.throttle = 1.0

    def serve(self, runtime: Any, job: str, announced: Any = None) -> None:
        self.served.append((job, runtime.stage))

    def trust(self, announced: Any) -> None:  # tests/stage_server/test_commit_auth.py
        pass

    def release(self) -> None:
        pass


async def _set(*args: Any) -> None:
    pass


def _agent(monkeypatch: pytest.MonkeyPatch) -> tuple[PeerAgent, _Servicer, ThreadPoolExecutor]:
    monkeypatch.setattr("stage_server.agent.measure_job", lambda *a: {0: 1.0, 1: 1.0})
    executor, servicer = ThreadPoolExecutor(1), _Servicer()
    running: Any = SimpleNamespace(
        address="127.0.0.1:1",
        executor=executor,
        servicer=servicer,
        health=SimpleNamespace(set=_set),
    )
    return PeerAgent(running, _Bus(), peer="p", device="cpu"), servicer, executor  # type: ignore[arg-type]


SPEC = render({**BASE, "training": {**BASE["training"], "stages": 2}})


def _now_us() -> int:
    return time.time_ns() // 1000


async def test_an_assignment_from_the_far_future_does_not_shut_out_the_real_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    agent, servicer, executor = _agent(monkeypatch)
    try:
        await agent._on_job(cpb.JobAnnouncement(job="j", spec=SPEC, state=cpb.JOB_STATE_PLACING))
        await agent.settled()  # its take-up (fetched, measured) done
        forged = cpb.Assignment(job="j", peer="p", stage=1, generation=2**64 - 1)
        await agent._on_assignment(forged)
        assert servicer.served == [], "a generation from the far future is refused"
        await agent._on_assignment(cpb.Assignment(job="j", peer="p", stage=0, generation=_now_us()))
        assert servicer.served == [("j", 0)], "the scheduler's next assignment is served"
    finally:
        executor.shutdown()


async def test_an_assignment_older_than_one_taken_is_ignored_and_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarted scheduler whose clock went back stamps its assignments before one this peer
    took: ignored (as a repeat is), but said; a repeat of the same stamp stays silent."""
    agent, servicer, executor = _agent(monkeypatch)
    try:
        await agent._on_job(cpb.JobAnnouncement(job="j", spec=SPEC, state=cpb.JOB_STATE_PLACING))
        await agent.settled()
        taken = cpb.Assignment(job="j", peer="p", stage=0, generation=_now_us())
        await agent._on_assignment(taken)
        await agent._on_assignment(taken)  # retained, again on a reconnect
        assert not [r for r in caplog.records if "ignored an assignment" in r.getMessage()]
        # another job's, retained from before (refused, or moved on from): silent too
        other = cpb.Assignment(job="k", peer="p", stage=1, generation=taken.generation - 1)
        await agent._on_assignment(other)
        assert not [r for r in caplog.records if "ignored an assignment" in r.getMessage()]
        older = cpb.Assignment(job="j", peer="p", stage=1, generation=taken.generation - 60_000_000)
        await agent._on_assignment(older)
        said = [r for r in caplog.records if "ignored an assignment" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.WARNING
        assert "stamped 60 s before one this peer took" in said[0].getMessage()
        assert servicer.served == [("j", 0)]
    finally:
        executor.shutdown()


async def test_an_active_announcement_undoes_a_forged_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    agent, servicer, executor = _agent(monkeypatch)
    try:
        forged = cpb.JobAnnouncement(job="j", spec=SPEC, state=cpb.JOB_STATE_CANCELLED)
        await agent._on_job(forged)
        await agent.settled()  # its take-up (fetched, measured) done
        await agent._on_job(cpb.JobAnnouncement(job="j", spec=SPEC, state=cpb.JOB_STATE_RUNNING))
        await agent.settled()  # its take-up (fetched, measured) done
        assert agent.job_id == "j", "the peer takes the job the scheduler announces running"
        await agent._on_assignment(cpb.Assignment(job="j", peer="p", stage=1, generation=_now_us()))
        assert servicer.served == [("j", 1)]
    finally:
        executor.shutdown()


async def test_a_stalled_job_keeps_its_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    # `stalled`: a stage of the job has no replica. The job runs on, and its peers must keep
    # serving it (a peer that took it for an end would empty every other stage too).
    agent, servicer, executor = _agent(monkeypatch)
    try:
        await agent._on_job(cpb.JobAnnouncement(job="j", spec=SPEC, state=cpb.JOB_STATE_RUNNING))
        await agent.settled()  # its take-up (fetched, measured) done
        await agent._on_assignment(cpb.Assignment(job="j", peer="p", stage=1, generation=_now_us()))
        await agent._on_job(cpb.JobAnnouncement(job="j", spec=SPEC, state=cpb.JOB_STATE_STALLED))
        await agent.settled()  # its take-up (fetched, measured) done
        assert agent.job_id == "j" and agent.stage == 1, "still serving the stalled job"
        assert servicer.served == [("j", 1)]
    finally:
        executor.shutdown()


# -- item 15: a job the peer fails to measure ---------------------------------------------------
class _Messages:
    """What the bus delivers, in order, then nothing more."""

    def __init__(self, *messages: cpb.JobAnnouncement) -> None:
        self.items = [(Topics().job(m.job), m) for m in messages]

    def __aiter__(self) -> _Messages:
        return self

    async def __anext__(self) -> tuple[str, cpb.JobAnnouncement]:
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)


def _placing(job: str, spec: str = SPEC) -> cpb.JobAnnouncement:
    return cpb.JobAnnouncement(job=job, spec=spec, state=cpb.JOB_STATE_PLACING)


async def test_a_job_the_peer_cannot_measure_does_not_capture_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    agent, _, executor = _agent(monkeypatch)
    published: list[cpb.PeerAnnouncement] = []

    async def publish(topic: str, message: Any, retain: bool = False) -> None:
        published.append(message)

    measured: list[int] = []  # the jobs' stage counts, one per measurement

    def measure(job: Any, *_: Any) -> dict[int, float]:
        measured.append(job.training.stages)
        if job.training.stages == 2:  # "big": more than this peer's memory
            raise RuntimeError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return {k: 1.0 for k in range(job.training.stages)}

    monkeypatch.setattr("stage_server.agent.measure_job", measure)
    monkeypatch.setattr(agent.bus, "publish", publish)
    small = render({**BASE, "training": {**BASE["training"], "stages": 3}})
    try:
        await agent._consume(_Messages(_placing("big")))
        await agent.settled()  # its take-up (fetched, measured) done
        assert agent.job_id == "" and agent.speeds == {}, "the refused job does not keep it"
        said = published[-1]
        assert (said.job, said.state, dict(said.samples_per_second)) == (
            "",
            cpb.PEER_STATE_JOINING,
            {},
        ), "it announces itself free again, so the scheduler can place it elsewhere"
        # and says why, for the job's status (before: in this peer's log alone, and the job
        # waited "for peers ... start more stage servers")
        assert said.refused_job == "big" and said.refused.startswith(
            "measuring its stages failed (RuntimeError: CUDA out of memory. Tried to allocate"
        ), said.refused
        await agent._consume(_Messages(_placing("big"), _placing("small", small)))
        await agent.settled()  # its take-up (fetched, measured) done
        assert measured == [2, 3], "the refused job is not measured again in a loop"
        assert agent.job_id == "small" and published[-1].job == "small"
        assert not published[-1].refused_job  # a job taken up: the refusal is old news
    finally:
        executor.shutdown()


def _spec(name: str, **training: int) -> str:
    return render({**BASE, "training": {**BASE["training"], "stages": 2, **training}}, name)


async def test_a_refused_job_is_tried_again_after_a_while_or_with_a_new_spec_and_others_go_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    agent, _, executor = _agent(monkeypatch)
    agent.clock = clock = FakeClock()
    measured: list[str] = []

    def measure(job: Any, *_: Any) -> dict[int, float]:
        measured.append(job.name)
        if job.name == "big":
            raise MemoryError("cannot allocate the stage")
        return {0: 1.0, 1: 1.0}

    monkeypatch.setattr("stage_server.agent.measure_job", measure)
    big = _placing("big", _spec("big"))
    try:
        await agent._consume(_Messages(big, big))
        await agent.settled()  # its take-up (fetched, measured) done
        assert measured == ["big"]
        clock.advance(REFUSED_RETRY_S + 1)  # a while later: perhaps memory was freed since
        await agent._consume(_Messages(big))
        await agent.settled()  # its take-up (fetched, measured) done
        assert measured == ["big", "big"]
        changed = _placing("big", _spec("big", steps=9))  # a new spec: tried at once
        await agent._consume(_Messages(changed))
        await agent.settled()  # its take-up (fetched, measured) done
        assert measured == ["big", "big", "big"] and agent.job_id == ""
        # Busy with job "a" while "big" and then "small" are announced: when "a" ends, the peer
        # refuses "big" and goes on to "small".
        await agent._consume(_Messages(_placing("a", _spec("a"))))
        await agent.settled()  # its take-up (fetched, measured) done
        clock.advance(REFUSED_RETRY_S + 1)
        await agent._consume(_Messages(big, _placing("small", _spec("small"))))
        await agent.settled()  # its take-up (fetched, measured) done
        assert agent.job_id == "a" and measured[3:] == ["a"]
        ended = cpb.JobAnnouncement(job="a", spec=_spec("a"), state=cpb.JOB_STATE_SUCCEEDED)
        await agent._consume(_Messages(ended))
        await agent.settled()  # its take-up (fetched, measured) done
        assert measured[4:] == ["big", "small"] and agent.job_id == "small"
    finally:
        executor.shutdown()


@pytest.mark.parametrize("moving", [False, True])
async def test_a_build_out_of_memory_returns_the_peer_to_idle_with_its_reason(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, moving: bool
) -> None:
    """Issue 41: a build that failed left the peer DRAINING (a move) or building, for good.
    Now it is idle again and says why (job, stage, free memory), its old stage released, and
    the job refused for a while (not measured and built again in a loop)."""
    agent, servicer, executor = _agent(monkeypatch)
    released: list[bool] = []
    monkeypatch.setattr(servicer, "release", lambda: released.append(True))
    published: list[cpb.PeerAnnouncement] = []

    async def publish(topic: str, message: Any, retain: bool = False) -> None:
        published.append(message)

    monkeypatch.setattr(agent.bus, "publish", publish)
    try:
        await agent._on_job(_placing("j"))
        await agent.settled()  # its take-up (fetched, measured) done
        if moving:
            await agent._on_assignment(
                cpb.Assignment(job="j", peer="p", stage=0, generation=_now_us())
            )
            assert agent.activity() == ("serving", "j", 0)

        def too_big(*args: Any) -> Any:
            raise out_of_memory("CUDA out of memory. Tried to allocate 80.00 GiB")

        monkeypatch.setattr("stage_server.agent.StageRuntime", too_big)
        await agent._on_assignment(cpb.Assignment(job="j", peer="p", stage=1, generation=_now_us()))
        assert agent.activity() == ("idle", "", None)
        assert (published[-1].job, published[-1].state) == ("", cpb.PEER_STATE_JOINING)
        assert released, "the old stage (or none) is let go: the scheduler placed it elsewhere"
        assert agent._still_refused(_placing("j"))
        said = " ".join(r.getMessage() for r in caplog.records)
        assert (
            "refused job j: building stage 1 failed (OutOfDeviceMemory: job test stage 1: "
            "out of device memory in building the stage (cpu)" in said
        ), said
    finally:
        executor.shutdown()


def test_every_announcement_of_one_process_carries_its_incarnation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Issue 51: the scheduler tells a reconnection from a restart by it (`scheduler.history`).
    agent, _, executor = _agent(monkeypatch)
    other, _, executor2 = _agent(monkeypatch)
    try:
        first = agent.announcement().incarnation
        assert first and agent.announcement().incarnation == first, "the same process: the same"
        assert other.announcement().incarnation != first, "another process: another"
    finally:
        executor.shutdown()
        executor2.shutdown()


async def test_a_spec_this_peer_cannot_parse_is_refused_said_and_parsed_once_off_the_loop(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A job with a key this peer's version does not know (a friend's machine on an older
    swarm): it logged an ERROR at each announcement (every few seconds) and said nothing the
    job's status could show, which asked for "a stage server" while this one was there. Now it
    is refused as a failed measurement is, named in the peer's announcement, and not parsed
    again for REFUSED_RETRY_S; the parse runs off the event loop (a 1 MiB spec takes seconds)."""
    agent, _, executor = _agent(monkeypatch)
    published: list[cpb.PeerAnnouncement] = []

    async def publish(topic: str, message: Any, retain: bool = False) -> None:
        published.append(message)

    threads: list[threading.Thread] = []

    def parse(*args: Any, **kwargs: Any) -> JobConfig:
        threads.append(threading.current_thread())
        return parse_job(*args, **kwargs)

    monkeypatch.setattr(agent.bus, "publish", publish)
    monkeypatch.setattr("stage_server.agent.parse_job", parse)
    newer = render({**BASE, "training": {**BASE["training"], "a_newer_key": 1}})
    try:
        for _ in range(3):  # announced again and again while the job places
            await agent._consume(_Messages(_placing("new", newer)))
            await agent.settled()
        assert agent.job_id == ""
        said = published[-1]
        assert said.refused_job == "new" and "a_newer_key" in said.refused, said.refused
        assert said.refused.startswith("reading its spec failed"), said.refused
        assert len(threads) == 1 and threading.main_thread() not in threads, threads
        errors = [r for r in caplog.records if "a_newer_key" in r.getMessage()]
        assert len(errors) == 1, [r.getMessage() for r in errors]
    finally:
        executor.shutdown()


async def test_a_job_that_ends_while_its_spec_is_parsed_is_not_taken_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The parse is off the loop: the job's end read meanwhile. Taken up after it, the peer sat
    measured for a dead job, never free again (until a reconnect brought the end once more)."""
    agent, _, executor = _agent(monkeypatch)
    gate = threading.Event()

    def slow(*args: Any, **kwargs: Any) -> JobConfig:
        gate.wait(5)
        return parse_job(*args, **kwargs)

    monkeypatch.setattr("stage_server.agent.parse_job", slow)
    try:
        taking = asyncio.create_task(agent._on_job(_placing("j")))
        await asyncio.sleep(0.1)  # parsing
        ended = cpb.JobAnnouncement(job="j", spec=SPEC, state=cpb.JOB_STATE_CANCELLED)
        await agent._on_job(ended)
        gate.set()
        await asyncio.wait_for(taking, 5)
        await agent.settled()
        assert agent.job_id == "" and agent.speeds == {} and "j" not in agent._jobs
    finally:
        gate.set()
        executor.shutdown()


# -- issue 68 item 9: a starting checkpoint not on this machine ----------------------------------
_FINETUNE = render(
    {
        **BASE,
        "model": {**BASE["model"], "init_from": "/not/here", "init_sha256": "a" * 64},
        "training": {**BASE["training"], "stages": 2},
    },
    "finetune",
)


async def test_a_checkpoint_not_here_is_fetched_before_the_stages_are_measured(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    agent, _, executor = _agent(monkeypatch)
    measured: list[Path | None] = []

    def measure(job: JobConfig, *_: Any) -> dict[int, float]:
        measured.append(job.model.init_from)
        return {0: 1.0, 1: 1.0}

    async def fetched(job_id: str, job: JobConfig) -> JobConfig:  # `InitSource`: the scheduler
        return replace(job, model=replace(job.model, init_from=tmp_path / job_id))

    monkeypatch.setattr("stage_server.agent.measure_job", measure)
    agent.init = fetched
    try:
        await agent._on_job(_placing("j", _FINETUNE))
        await agent.settled()  # its take-up (fetched, measured) done
        assert measured == [tmp_path / "j"] and agent.job_id == "j"
        assert agent._jobs["j"].model.init_from == tmp_path / "j"  # what an assignment builds
    finally:
        executor.shutdown()


async def test_a_jobs_fetched_checkpoint_is_held_until_the_job_ends(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """While the peer knows the job it may read the checkpoint again (each assignment, each
    move): no room-making removes it. Once the job ends it is let go."""
    agent, _, executor = _agent(monkeypatch)
    monkeypatch.setattr("stage_server.agent.measure_job", lambda *_: {0: 1.0, 1: 1.0})
    cache, locks = tmp_path / "init", tmp_path / "locks"
    (cache / "p").mkdir(parents=True)

    async def fetched(job_id: str, job: JobConfig) -> JobConfig:  # as scheduler_init holds it
        agent.uses.keep(job_id, await hold(locks, "init", "p"))
        return replace(job, model=replace(job.model, init_from=cache / "p"))

    agent.init = fetched
    try:
        await agent._on_job(_placing("j", _FINETUNE))
        await agent.settled()
        assert agent.job_id == "j"
        assert drop_unused_items(cache, locks, "init", "", stale_s=0.0) == []
        # the worker still building from it (a job ended mid-build): held until that ends
        building = threading.Event()
        executor.submit(building.wait, 10)
        ended = cpb.JobAnnouncement(job="j", spec=_FINETUNE, state=cpb.JOB_STATE_CANCELLED)
        await agent._on_job(ended)
        assert agent.job_id == "" and agent.uses.held("j") == []
        assert drop_unused_items(cache, locks, "init", "", stale_s=0.0) == []
        building.set()
        await asyncio.wrap_future(executor.submit(lambda: None))  # the worker's queue, run
        assert drop_unused_items(cache, locks, "init", "", stale_s=0.0) == ["p"]
    finally:
        executor.shutdown()


async def test_a_checkpoint_not_here_with_no_scheduler_refuses_the_job_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    agent, _, executor = _agent(monkeypatch)
    try:
        await agent._on_job(_placing("j", _FINETUNE))
        await agent.settled()  # its take-up (fetched, measured) done
        assert agent.job_id == "" and agent.speeds == {}
        assert "give it --scheduler HOST:PORT" in caplog.text
        assert "fetching its starting checkpoint failed" in caplog.text
    finally:
        executor.shutdown()


# -- a job's take-up (its checkpoint fetched, its stages measured) holds no job message -----------
class _Subscription:
    """A bus subscription: each message as it is published, until the test ends."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[str, cpb.JobAnnouncement]] = asyncio.Queue()

    def publish(self, message: cpb.JobAnnouncement) -> None:
        self.queue.put_nowait((Topics().job(message.job), message))

    def __aiter__(self) -> _Subscription:
        return self

    async def __anext__(self) -> tuple[str, cpb.JobAnnouncement]:
        return await self.queue.get()


async def test_a_cancel_reaches_a_peer_while_it_fetches_the_jobs_checkpoint(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A friend's peer fetching a fine-tune's checkpoint (hours of it on a home link) read no
    job message meanwhile: it showed "idle", a cancel of the job waited for the whole fetch
    (then the peer measured the cancelled job), and a job announced meanwhile waited too. Now
    it shows "fetching", a cancel stops the fetch at once, and the peer goes on to the next."""
    caplog.set_level(logging.INFO, "stage_server.agent")
    agent, _, executor = _agent(monkeypatch)
    fetching, stopped = asyncio.Event(), []

    async def stalled(job_id: str, job: JobConfig) -> JobConfig:  # the scheduler's stream
        fetching.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            stopped.append(job_id)
            raise
        raise AssertionError("never fetched")

    agent.init = stalled
    bus = _Subscription()
    consuming = asyncio.create_task(agent._consume(bus))
    try:
        bus.publish(_placing("j", _FINETUNE))
        await asyncio.wait_for(fetching.wait(), 5)
        assert agent.activity() == ("fetching", "j", None)
        bus.publish(cpb.JobAnnouncement(job="j", spec=_FINETUNE, state=cpb.JOB_STATE_CANCELLED))
        bus.publish(_placing("k"))
        await wait_until(lambda: agent.speeds, "the next job measured", timeout_s=5)
        assert stopped == ["j"] and agent.job_id == "k"
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "stopped fetching job j's starting checkpoint: it was cancelled" in said, said
    finally:
        consuming.cancel()
        executor.shutdown()


async def test_a_load_report_that_cannot_be_made_once_stops_no_report_after_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Reading what the activation cache holds reads the device's claims (files: an OSError
    there, a full descriptor table). Raised out of the report loop, it ended the agent's task
    group: the peer process, and every stage it served. It is said, and the next report goes."""
    agent, _, executor = _agent(monkeypatch)
    sent: list[cpb.LoadReport] = []

    async def publish(topic: str, message: Any, retain: bool = False) -> None:
        if isinstance(message, cpb.LoadReport):
            sent.append(message)

    failures = [OSError(24, "Too many open files")]

    def capacity(runtime: Any) -> int:
        if failures:
            raise failures.pop()
        return 8

    runtime = SimpleNamespace(job=SimpleNamespace(training=SimpleNamespace(microbatch_size=2)))
    runtime.is_last = False
    agent.running.servicer = SimpleNamespace(  # type: ignore[misc]
        runtime=runtime,
        ema_seconds=0.5,
        waiting=0,
        metrics=SimpleNamespace(boundary=SimpleNamespace(report=cpb.BoundaryTraffic)),
        limits=SimpleNamespace(capacity=capacity),
    )
    monkeypatch.setattr(agent.bus, "publish", publish)
    agent.state, agent.stage, agent.job_id, agent.load_period_s = (
        cpb.PEER_STATE_SERVING,
        0,
        "j",
        0.01,
    )
    reporting = asyncio.create_task(agent._report_load())
    try:
        await wait_until(lambda: bool(sent) or reporting.done(), "a load report sent", timeout_s=5)
        assert not reporting.done(), reporting.exception()
        assert sent[0].activation_capacity == 8
        assert "load report not made or sent: [Errno 24] Too many open files" in caplog.text
    finally:
        reporting.cancel()
        await asyncio.gather(reporting, return_exceptions=True)
        executor.shutdown()
