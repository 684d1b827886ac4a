"""A peer that goes away while building the stage it was given (`scheduler.build_crashes`): the
kernel's out-of-memory killer, say, with a supervisor that restarts it. Placement waited out
`serve_timeout_s` for a peer that was gone, and placed the restarted one again, to be killed
again, for ever, while the job's status said "starting 1 stage server(s)". Now each loss is
said, placement goes on at once, and after `CRASHES` in a row the peer is paused out of the job
(named in its message, with until when), whatever its incarnation."""

from __future__ import annotations

import asyncio
import logging

import pytest

from scheduler.build_crashes import CRASHES, KEPT, PAUSE_S, BuildCrashes
from swarm.clock import FakeClock
from swarm.deadline import within
from swarm.proto import control_pb2 as cpb
from tests.support.placement import measured, placement
from tests.support.waiting import wait_until

TIMEOUT_S = 60.0


def _gone(peer: str) -> cpb.PeerAnnouncement:
    return cpb.PeerAnnouncement(peer=peer, state=cpb.PEER_STATE_OFFLINE)


async def test_a_peer_killed_building_its_stage_again_and_again_is_said_and_paused_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    registry, assignments = placement(clock, TIMEOUT_S)
    given: list[str] = []
    for restart in range(CRASHES + 1):
        registry.announce(measured("x", incarnation=str(restart)))  # (re)started, measured
        available = assignments.available("j", 1)
        if not available:
            break
        await assignments._assign_available("j", available, given, 1)
        clock.advance(5.0)  # building...
        registry.announce(_gone("x"))  # ...killed: its last will
        assignments.available("j", 1)
    assert given == ["x"] * CRASHES, "placed again after each restart, for ever"
    lost = [r for r in caplog.records if "x went away while building stage 0" in r.getMessage()]
    assert len(lost) == CRASHES and all(r.levelno == logging.WARNING for r in lost)
    assert f"not given this job again for {PAUSE_S:.0f} s" in lost[-1].getMessage()
    words = assignments.crashes.words("j")
    assert "left out after going away 3 times in a row while building their stage: x (stage 0" in (
        words
    )
    clock.advance(PAUSE_S + 1)  # its operator's fix is tried then
    assert assignments.available("j", 1) == {"x": [5.0]}
    assert assignments.crashes.words("j") == ""


REFUSAL = "building stage 0 failed (OutOfMemoryError: CUDA out of memory)"


@pytest.mark.parametrize(
    "word",
    [
        _gone("x"),  # its last will: killed building
        # free again, refusing the job, with why (`stage_server.agent`): the old code waited
        # it out too, while the job's message said a stage server was starting
        cpb.PeerAnnouncement(peer="x", refused_job="j", refused=REFUSAL),
    ],
    ids=["gone", "refused"],
)
async def test_placement_goes_on_at_once_when_the_peer_it_waits_for_will_not_serve(
    word: cpb.PeerAnnouncement,
) -> None:
    clock = FakeClock()
    registry, assignments = placement(clock, TIMEOUT_S)
    registry.announce(measured("x", "1"))
    await assignments._assign_available("j", assignments.available("j", 1), [], 1)
    waiting = asyncio.create_task(assignments._wait_serving("j", [0]))
    await asyncio.sleep(0.1)
    assert not waiting.done()  # x builds: waited for
    registry.announce(word)
    assignments.changed.set()  # as the scheduler's bus reader does
    await within(waiting, 5.0)  # the old code waited out serve_timeout_s (60 s here)
    assert assignments.on_the_way("j", 1) == [[]]
    assert ("j", "x") not in assignments.no_shows._missed  # neither is a silent miss


async def test_a_stage_nobody_was_given_is_waited_for_as_before() -> None:
    """Only a stage whose peers went away ends the wait early: one given to nobody (its peer
    held back, say) is waited for, not placed again in a loop."""
    _, assignments = placement(FakeClock(), TIMEOUT_S)
    waiting = asyncio.create_task(assignments._wait_serving("j", [0]))
    assignments.changed.set()
    await asyncio.sleep(0.2)
    assert not waiting.done()
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


def test_what_is_kept_is_bounded_and_a_served_stage_or_an_ended_job_clears_it() -> None:
    clock = FakeClock()
    crashes = BuildCrashes(clock)
    for k in range(KEPT + 10):
        crashes.lost("j", f"p{k}", 0)
    assert len(crashes._lost) == KEPT
    for _ in range(CRASHES):
        crashes.lost("j", "x", 1)
    assert crashes.left_out("j", "x") and not crashes.left_out("other", "x")
    crashes.served("j", "x")
    assert not crashes.left_out("j", "x")
    crashes.lost("j", "x", 1)
    crashes.forget("j")
    assert not crashes._lost


async def test_a_peer_that_served_and_then_went_away_is_no_build_crash() -> None:
    """The wait ended as every stage served, before the arrival was recorded: a peer lost a
    moment later (its first microbatch's memory) was counted as lost while building."""
    clock = FakeClock()
    registry, assignments = placement(clock, TIMEOUT_S)
    registry.announce(measured("x", "1"))
    await assignments._assign_available("j", assignments.available("j", 1), [], 1)
    waiting = asyncio.create_task(assignments._wait_serving("j", [0]))
    await asyncio.sleep(0.05)  # it waits for x now
    registry.announce(
        cpb.PeerAnnouncement(
            peer="x", address="x:1", job="j", stage=0, state=cpb.PEER_STATE_SERVING, incarnation="1"
        )
    )
    assignments.changed.set()
    await within(waiting, 5.0)
    registry.announce(_gone("x"))
    assignments.available("j", 1)
    assert not assignments.crashes._lost


async def test_a_stage_whose_peer_went_away_is_given_to_a_free_one_while_another_builds() -> None:
    """Two stages: p, given one, is killed building it while q still builds the other, and r is
    free: placement counted q's stage as needing a peer too, asked for one more, and r waited
    until q served (a review found it)."""
    clock = FakeClock()
    registry, assignments = placement(clock, TIMEOUT_S)
    two = {0: 5.0, 1: 5.0}
    for peer in ("p", "q"):
        registry.announce(measured(peer, "1", speeds=two))
    given: list[str] = []
    await assignments._assign_available("j", assignments.available("j", 2), given, 1)
    lost = registry.given("j", "p")
    placing = asyncio.create_task(assignments.place("j", 2, lambda: 0, given))
    try:
        await asyncio.sleep(0.05)
        registry.announce(_gone("p"))
        registry.announce(measured("r", "1", speeds=two))
        assignments.changed.set()
        await wait_until(lambda: "r" in given, "r is given p's stage", timeout_s=5)
        assert registry.given("j", "r") == lost
    finally:
        placing.cancel()
        await asyncio.gather(placing, return_exceptions=True)
