"""A peer's agent against forged control messages (issue 27, item 5): one message on the bus,
published by anyone who may publish there, must not disable a peer until it restarts."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest

from stage_server.agent import PeerAgent
from swarm.bus.topics import Topics
from swarm.proto import control_pb2 as cpb
from tests.support.jobs import BASE, render


class _Bus:
    topics = Topics()

    async def publish(self, topic: str, message: Any, retain: bool = False) -> None:
        pass


class _Servicer:
    def __init__(self) -> None:
        self.served: list[tuple[str, int]] = []
        self.throttle = 1.0

    def serve(self, runtime: Any, job: str) -> None:
        self.served.append((job, runtime.stage))

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
        forged = cpb.Assignment(job="j", peer="p", stage=1, generation=2**64 - 1)
        await agent._on_assignment(forged)
        assert servicer.served == [], "a generation from the far future is refused"
        await agent._on_assignment(cpb.Assignment(job="j", peer="p", stage=0, generation=_now_us()))
        assert servicer.served == [("j", 0)], "the scheduler's next assignment is served"
    finally:
        executor.shutdown()


async def test_an_active_announcement_undoes_a_forged_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    agent, servicer, executor = _agent(monkeypatch)
    try:
        forged = cpb.JobAnnouncement(job="j", spec=SPEC, state=cpb.JOB_STATE_CANCELLED)
        await agent._on_job(forged)
        await agent._on_job(cpb.JobAnnouncement(job="j", spec=SPEC, state=cpb.JOB_STATE_RUNNING))
        assert agent.job_id == "j", "the peer takes the job the scheduler announces running"
        await agent._on_assignment(cpb.Assignment(job="j", peer="p", stage=1, generation=_now_us()))
        assert servicer.served == [("j", 1)]
    finally:
        executor.shutdown()
