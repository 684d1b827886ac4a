"""A move on a device that cannot hold two stages (issue 41, deliverable 4): the peer builds the
new stage beside the old one when its free memory holds both, and releases the old one first
when it does not (before, it always built beside, out of memory on a GPU, killed by the kernel
on a CPU); either way it ends serving the new stage. Device memory is faked
(`tests.support.devices`): the host's available memory of a CPU peer."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from stage_server.agent import PeerAgent
from stage_server.peer.fits import footprints
from stage_server.replica.runtime import StageRuntime
from swarm.bus.topics import Topics
from swarm.job.config import parse_job
from swarm.proto import control_pb2 as cpb
from tests.support.devices import FakeFacts
from tests.support.jobs import BASE, render

pytestmark = pytest.mark.timeout(120)

SPEC = render({**BASE, "training": {**BASE["training"], "stages": 2}})


class _Servicer:
    """Records what the peer does, in order, with its bus announcements."""

    def __init__(self, events: list[str]) -> None:
        self.events, self.throttle = events, 1.0

    def serve(self, runtime: Any, job: str, announced: Any = None) -> None:
        self.events.append(f"serve {runtime.stage}")

    def trust(self, announced: Any) -> None:
        pass

    def release(self) -> None:
        self.events.append("release")


async def _set(*args: Any) -> None:
    pass


def _now_us() -> int:
    return time.time_ns() // 1000


async def _move(monkeypatch: pytest.MonkeyPatch, free: int) -> list[str]:
    """Serve stage 0, then be moved to stage 1 with `free` bytes available: what happened."""
    events: list[str] = []
    monkeypatch.setattr("stage_server.agent.measure_job", lambda *a: {0: 1.0, 1: 1.0})

    def build(job: Any, stage: int, device: Any) -> StageRuntime:
        events.append(f"build {stage}")
        return StageRuntime(job, stage, device)

    monkeypatch.setattr("stage_server.agent.StageRuntime", build)

    class _Bus:
        topics = Topics()

        async def publish(self, topic: str, message: Any, retain: bool = False) -> None:
            events.append(cpb.PeerState.Name(message.state))

    executor = ThreadPoolExecutor(1)
    running: Any = SimpleNamespace(
        address="127.0.0.1:1",
        executor=executor,
        servicer=_Servicer(events),
        health=SimpleNamespace(set=_set),
    )
    agent = PeerAgent(running, _Bus(), peer="p", device="cpu")  # type: ignore[arg-type]
    agent.facts = FakeFacts(host=free)  # the host's available memory, as the peer reads it
    try:
        await agent._on_job(cpb.JobAnnouncement(job="j", spec=SPEC, state=cpb.JOB_STATE_PLACING))
        await agent.settled()  # its take-up (fetched, measured) done
        await agent._on_assignment(cpb.Assignment(job="j", peer="p", stage=0, generation=_now_us()))
        events.clear()
        await agent._on_assignment(cpb.Assignment(job="j", peer="p", stage=1, generation=_now_us()))
        assert agent.activity() == ("serving", "j", 1), "it ends serving the new stage"
    finally:
        executor.shutdown()
    return events


def _footprints() -> list[Any]:
    return footprints(parse_job(SPEC, Path("/"), name="job", check_data=False))


async def test_a_move_that_fits_builds_the_new_stage_beside_the_old(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    old, new = _footprints()
    events = await _move(monkeypatch, new.total + old.total)
    assert events == ["PEER_STATE_DRAINING", "build 1", "serve 1", "PEER_STATE_SERVING"], events


async def test_a_move_that_cannot_fit_beside_releases_the_old_stage_first(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "stage_server.agent")
    old, new = _footprints()
    assert old.activations > 0  # the old stage's activations count: the new one alone fits
    events = await _move(monkeypatch, new.total)  # the new one alone fits, not both
    assert events == [
        "PEER_STATE_DRAINING",  # the scheduler stops sending it the old stage's work first
        "release",
        "build 1",
        "serve 1",
        "PEER_STATE_SERVING",
    ], events
    said = caplog.text
    assert "releasing stage 0 before building stage 1: stage 1 needs" in said, said
    assert "available (MemAvailable) on cpu" in said
