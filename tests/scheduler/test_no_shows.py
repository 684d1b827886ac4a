"""A peer given a stage that it never serves (`scheduler.no_shows`): a stage server dropped an
assignment without a word to the scheduler (its clock more than 5 minutes behind, say), stayed
measured, and placement offered it the same stage again after each `serve_timeout_s`, for ever,
while the job's status said "starting 1 stage server(s)". Now each miss is said, and after
`NO_SHOWS` in a row the peer is left out of the job, named in its message, until it restarts."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from scheduler.assignments import Assignments
from scheduler.no_shows import NO_SHOWS
from scheduler.registry import PeerRegistry
from swarm.clock import FakeClock
from swarm.deadline import within
from swarm.proto import control_pb2 as cpb
from tests.support.fakes import SilentBus
from tests.support.placement import measured, placement
from tests.support.waiting import wait_until

TIMEOUT_S = 60.0


def _placement(clock: FakeClock) -> tuple[PeerRegistry, Assignments]:
    return placement(clock, TIMEOUT_S)


async def test_a_peer_that_never_serves_its_stage_is_said_and_left_out_after_three(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    registry, assignments = placement(clock, TIMEOUT_S)
    registry.announce(measured("x"))  # measured for the one-stage job; drops what it is given
    given: list[str] = []
    for _ in range(NO_SHOWS + 2):
        await assignments._assign_available("j", assignments.available("j", 1), given, 1)
        clock.advance(TIMEOUT_S + 1)
    assert given == ["x"] * NO_SHOWS, "given the stage again after each timeout, for ever"
    misses = [r for r in caplog.records if "did not serve it within 60 s" in r.getMessage()]
    assert len(misses) == NO_SHOWS and all(r.levelno == logging.WARNING for r in misses)
    assert "not given this job again until it restarts" in misses[-1].getMessage()
    words = assignments.no_shows.words("j", {"x": "1"})
    assert "left out after 3 assignments in a row they did not serve: x (stage 0)" in words
    # restarted (its clock fixed): placed again
    registry.announce(measured("x", incarnation="2"))
    assert assignments.available("j", 1) == {"x": [5.0]}
    # and a peer that serves what it is given is never counted
    registry.announce(measured("y"))
    await assignments._assign_available("j", {"y": [5.0]}, given, 1)
    registry.announce(
        cpb.PeerAnnouncement(
            peer="y", address="y:1", job="j", stage=0, state=cpb.PEER_STATE_SERVING, incarnation="1"
        )
    )
    clock.advance(TIMEOUT_S + 1)
    assignments.available("j", 1)
    assert not [r for r in caplog.records if "y was given" in r.getMessage()]


async def test_an_ended_jobs_misses_and_gone_peers_are_forgotten() -> None:
    clock = FakeClock()
    registry, assignments = _placement(clock)
    for peer in ("x", "z"):
        assignments.no_shows.missed("j", peer, 0, "1")
    registry.announce(measured("x"))
    assignments.available("j", 1)  # z is not here: forgotten
    assert set(k[1] for k in assignments.no_shows._missed) == {"x"}
    await assignments.withdraw("j", {"x"})
    assert assignments.no_shows._missed == {}


async def test_a_peer_serving_the_job_has_no_misses_in_a_row_and_a_withdrawn_job_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    registry, assignments = _placement(clock)
    for _ in range(NO_SHOWS - 1):  # a slow build past the timeout, twice
        assignments.no_shows.missed("j", "x", 0, "1")
    registry.announce(
        cpb.PeerAnnouncement(
            peer="x", address="x:1", job="j", stage=0, state=cpb.PEER_STATE_SERVING, incarnation="1"
        )
    )
    assignments.available("j", 1)  # it serves now: days later one more miss is not its third
    assert assignments.no_shows._missed == {}
    # a job withdrawn while its peer built: that assignment is void, never a miss
    registry.announce(measured("y"))
    await assignments._assign_available("k", {"y": [5.0]}, [], 1)
    await assignments.withdraw("k", {"y"})
    clock.advance(TIMEOUT_S + 1)
    assignments.available("j", 1)
    assert not [r for r in caplog.records if "y was given" in r.getMessage()]


class _LinkDown(SilentBus):
    """A bus waiting for its broker: each retained publish waits (up to `publish_timeout_s` on
    the real one) until `back` is set."""

    def __init__(self) -> None:
        self.waiting: list[str] = []
        self.back = asyncio.Event()

    async def publish(self, topic: str, message: Any, retain: bool = False) -> None:
        self.waiting.append(topic)
        await self.back.wait()


async def test_an_ended_jobs_assignments_are_withdrawn_at_once_not_one_wait_each() -> None:
    """A cancelled job's cleanup, with the broker away, waited out each peer's withdrawal in
    turn (10 s each): a DeleteJob was refused all that while (a review found it)."""
    bus = _LinkDown()
    registry = PeerRegistry(FakeClock(), load_silence_s=1e9, serve_timeout_s=TIMEOUT_S)

    async def say(job: str, text: str) -> None:
        pass

    assignments = Assignments(
        registry, bus, say, grace_s=0.0, serve_timeout_s=TIMEOUT_S, lost_stage_grace_s=0.0
    )
    withdrawing = asyncio.create_task(assignments.withdraw("j", {"x", "y", "z"}))
    await wait_until(
        lambda: len(bus.waiting) == 3, "the withdrawals under way together", timeout_s=5
    )
    bus.back.set()
    await within(withdrawing, 5)
    assert sorted(bus.waiting) == [bus.topics.assign("j", p) for p in ("x", "y", "z")]
