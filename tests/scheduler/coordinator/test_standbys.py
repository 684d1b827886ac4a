"""Which peers stand by for a stage, what status says of them, their promotion and the words of a
rollback that found none to promote (`scheduler.coordinator.standbys`)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from scheduler.coordinator.standbys import (
    COPY_STEPS,
    FAILED_ASKS,
    LAG_BOUND,
    LAG_STEPS,
    LOST_COOLDOWN_S,
    Standbys,
)
from swarm.errors import SwarmError
from swarm.rpc.lease import Replica

HOSTS = {"a": "h1", "b": "h2", "c": "h3", "d": "h1", "e": "h4", "f": "h5", "g": "h2"}


def _standbys(wanted: int = 1, only_spares: bool = False) -> Standbys:
    return Standbys(wanted, lambda peer: HOSTS[peer], only_spares=only_spares)


def test_none_wanted_none_chosen() -> None:
    members = [[Replica("a", "x:1"), Replica("b", "x:2")]]
    assert _standbys(0).choose(members, {"a", "b"}) == []


def test_never_the_last_replica_nor_one_on_a_replicas_host() -> None:
    standbys = _standbys()
    # One replica alone: it keeps serving. Two on one host: neither may stand by for the other.
    members = [[Replica("a", "x:1")], [Replica("a", "x:1"), Replica("d", "x:4")]]
    assert standbys.choose(members, {"a", "d"}) == []
    assert standbys.of("a") is None and standbys.of("d") is None


def test_the_slowest_replica_on_another_host_stands_by() -> None:
    standbys = _standbys()
    members = [[Replica("a", "x:1", 5.0), Replica("b", "x:2", 1.0), Replica("c", "x:3", 3.0)]]
    assert standbys.choose(members, {"a", "b", "c"}) == ["b"]
    assert standbys.of("b") == 0
    # Chosen once: the next boundary keeps it, and takes no more.
    assert standbys.choose(members, {"a", "c"}) == []


def test_a_joiner_stands_by_before_a_replica_and_is_no_member_to_demote() -> None:
    standbys = _standbys()
    members = [[Replica("a", "x:1"), Replica("b", "x:2", 0.5), Replica("c", "x:3")]]
    assert standbys.choose(members, {"a", "b"}) == []  # c, a joiner, serves nothing yet
    assert standbys.of("c") == 0


def test_a_peer_only_saying_it_serves_the_stage_never_stands_by() -> None:
    """A joiner the scheduler never placed on the job, nor its coordinator admitted (it only
    announced the stage: N9's flipping peer), is given no state: a vouched one stands by."""
    standbys = Standbys(1, lambda peer: HOSTS[peer], vouched=lambda peer: peer != "c")
    members = [[Replica("a", "x:1", 5.0), Replica("b", "x:2", 0.5), Replica("c", "x:3")]]
    assert standbys.choose(members, {"a", "b"}) == ["b"]  # c, unvouched, is passed by
    assert standbys.of("c") is None and standbys.of("b") == 0


def test_a_standby_gone_is_forgotten_and_replaced() -> None:
    standbys = _standbys()
    three = [[Replica("a", "x:1"), Replica("b", "x:2"), Replica("c", "x:3")]]
    assert standbys.choose(three, {"a", "b", "c"}) == ["a"]
    assert standbys.choose([three[0][1:]], {"b", "c"}) == ["b"]
    assert standbys.of("a") is None


def test_a_standby_gone_and_back_stands_by_again_only_after_its_cooldown() -> None:
    """Once lost as a standby, a peer stands by again only `LOST_COOLDOWN_S` later (a flipping
    peer would stand by, and be said to, on every flip: N9)."""
    now = [100.0]
    standbys = Standbys(1, lambda peer: HOSTS[peer], clock=lambda: now[0])
    three = [[Replica("a", "x:1", 3.0), Replica("b", "x:2", 0.5), Replica("c", "x:3", 5.0)]]
    assert standbys.choose(three, {"a", "b", "c"}) == ["b"]
    assert standbys.choose([[three[0][0], three[0][2]]], {"a", "c"}) == ["a"]  # b gone
    # a gone too, b back (joining again): b does not stand by yet, and c, alone, serves
    assert standbys.choose([three[0][1:]], {"c"}) == []
    assert standbys.of("b") is None and standbys.of("a") is None
    now[0] += LOST_COOLDOWN_S  # the cooldown over: b, joining, stands by again
    assert standbys.choose([three[0][1:]], {"c"}) == []
    assert standbys.of("b") == 0


def test_status_says_the_standbys_lag_in_steps() -> None:
    standbys = _standbys()
    standbys.choose([[Replica("a", "x:1"), Replica("b", "x:2")]], {"a", "b"})
    assert standbys.words("a", 7, "b") == "standby for stage 0: copying the state of b"
    standbys.answered("a", 6)
    assert standbys.words("a", 7, "b") == "standby for stage 0, 1 step behind (following b)"
    standbys.answered("a", 7)
    assert standbys.words("a", 7, "b") == "standby for stage 0, 0 steps behind (following b)"


def test_promotion_is_told_once_and_only_for_a_standby() -> None:
    standbys, told = _standbys(), []
    standbys.promoted.append(lambda step, stage, peer: told.append((step, stage, peer)))
    standbys.choose([[Replica("a", "x:1"), Replica("b", "x:2")]], {"a", "b"})
    assert not standbys.promote(7, 0, "b")  # a replica re-admitted: no promotion
    assert standbys.promote(7, 0, "a")
    assert not standbys.promote(7, 0, "a")
    assert told == [(7, 0, "a")]


def test_a_rollback_says_why_no_standby_took_the_stage() -> None:
    standbys = _standbys()
    standbys.choose([[Replica("a", "x:1"), Replica("b", "x:2")], [Replica("c", "x:3")]], {"a", "b"})
    standbys.explain([0], 7, {"a": 6})
    assert standbys.missed == (
        "stage 0's standby a was at step 6, not 7: the updates it lacked were lost with the stage"
    )
    standbys.explain([0, 1], 7, {})
    assert standbys.missed == (
        "stage 0 had no standby (its standby a was lost with it); stage 1 had no standby"
    )
    _standbys(0).explain([0], 7, {})  # none wanted: nothing to say


def test_a_standby_a_rollback_made_a_member_stands_by_again() -> None:
    standbys = _standbys()
    members = [[Replica("a", "x:1"), Replica("b", "x:2")]]
    assert standbys.choose(members, {"a", "b"}) == ["a"]
    # The rollback loaded its checkpoint on every listed peer: both are members again.
    assert standbys.choose(members, {"a", "b"}) == ["a"]
    # The rollback was for b's loss: a is the stage's only replica now, and stays one.
    assert standbys.choose([[a for a in members[0] if a.peer == "a"]], {"a"}) == []
    assert standbys.of("a") is None


def test_a_standby_is_asked_in_the_background_one_ask_at_a_time() -> None:
    # The pool never waits for a standby: its Join, asked as a step opens, runs by itself, and
    # one still on its way (a slow link) is not joined by another.
    async def run() -> None:
        standbys = _standbys()
        a, b = Replica("a", "x:1"), Replica("b", "x:2")
        standbys.choose([[a, b]], {"a", "b"})
        slow, sent = asyncio.Event(), []

        async def join(at: int) -> int:
            sent.append(at)
            await slow.wait()
            return at

        assert standbys.nudge(a, join(7), 7)
        await asyncio.sleep(0)
        second = join(8)
        assert standbys.nudge(a, second, 8)  # taken, and closed unsent: the first is on its way
        third = join(9)
        assert not standbys.nudge(b, third, 9)  # no standby: the caller's to await
        third.close()
        slow.set()
        await asyncio.sleep(0.01)
        assert sent == [7]
        assert standbys.lag("a", 7) == 0
        assert standbys.asking()  # cancelled as the coordinator closes

    asyncio.run(run())


def test_a_spare_stands_by_before_a_peer_the_job_needs() -> None:
    # Stage 1 (10 samples/s) is the bottleneck; stage 0 keeps 13 without a, 7 without c: a is
    # spare, c (a joiner, fast) is needed. A spare first: the standby costs the job nothing.
    members = [
        [Replica("a", "x:1", 2.0), Replica("b", "x:2", 5.0), Replica("c", "x:3", 8.0)],
        [Replica("e", "x:5", 10.0)],
    ]
    standbys = _standbys()
    assert standbys.choose(members, {"a", "b", "e"}) == ["a"]
    assert standbys.of("a") == 0 and standbys.of("c") is None


def test_where_the_swarm_has_room_only_a_spare_stands_by() -> None:
    # "auto" (only spares): one peer per stage, or two equal stages of two, have none to spare
    # and run as they did; a third peer beyond the bottleneck stands by.
    one_each = [[Replica("a", "x:1", 10.0)], [Replica("b", "x:2", 10.0)]]
    assert _standbys(only_spares=True).choose(one_each, {"a", "b"}) == []
    two_each = [
        [Replica("a", "x:1", 10.0), Replica("b", "x:2", 10.0)],
        [Replica("c", "x:3", 10.0), Replica("e", "x:5", 10.0)],
    ]
    standbys = _standbys(only_spares=True)
    assert standbys.choose(two_each, {"a", "b", "c", "e"}) == []
    assert standbys.peers() == set()
    room = [[*two_each[0], Replica("f", "x:6", 10.0)], two_each[1]]
    assert standbys.choose(room, {"a", "b", "c", "e"}) == []  # f, a joiner, stands by
    assert standbys.peers() == {"f"}


def test_a_standby_the_job_comes_to_need_serves_again() -> None:
    standbys, said = _standbys(only_spares=True), []
    standbys.said.append(lambda stage, peer, text: said.append(text))
    stage0 = [Replica("a", "x:1", 10.0), Replica("b", "x:2", 10.0)]
    assert standbys.choose([stage0, [Replica("c", "x:3", 10.0)]], {"a", "b", "c"}) == ["a"]
    # Stage 1 gains a peer: stage 0 without its standby is the job's bottleneck now.
    grown = [stage0, [Replica("c", "x:3", 10.0), Replica("e", "x:5", 10.0)]]
    assert standbys.choose(grown, {"b", "c", "e"}) == []
    assert standbys.peers() == set()
    assert said == [
        "standby a of stage 0 serves again: the job needs it as a replica (without it the "
        "slowest stage is slower); a spare stands by when there is one"
    ]


def test_a_standby_that_falls_behind_is_replaced_by_another() -> None:
    async def run() -> None:
        standbys, said = _standbys(), []
        standbys.said.append(lambda stage, peer, text: said.append((stage, peer, text)))
        members = [[Replica("a", "x:1", 9.0), Replica("b", "x:2", 1.0), Replica("c", "x:3")]]
        assert standbys.choose(members, {"a", "b"}) == []
        assert standbys.peers() == {"c"}  # the joiner

        async def at(step: int) -> int:
            return step

        # It answers, but stays at step 1 while the job goes on: behind for LAG_STEPS steps
        # in a row past LAG_BOUND, it is replaced; the pool never awaited it meanwhile.
        step = 2
        for _ in range(LAG_BOUND + LAG_STEPS):
            assert standbys.nudge(members[0][2], at(1), step)
            await asyncio.sleep(0)
            step += 1
        assert standbys.of("c") is None and "c" in standbys.passed_over
        assert said == [
            (
                0,
                "c",
                f"standby c of stage 0 replaced: it was more than {LAG_BOUND} steps behind as "
                f"{LAG_STEPS} steps in a row opened ({step - 2} at step {step - 1}): its link "
                "does not keep up with the updates; another peer of the stage stands by from the "
                "next step, if one may",
            )
        ]
        # Another candidate stands by at the next boundary, never the one replaced; its asks
        # still run in the background (its own loop admits it once it caught up).
        assert standbys.choose(members, {"a", "b"}) == ["b"]
        assert standbys.nudge(members[0][2], at(step), step)
        await asyncio.sleep(0)

    asyncio.run(run())


def test_a_standby_whose_asks_keep_failing_is_replaced() -> None:
    async def run() -> None:
        standbys, said = _standbys(), []
        standbys.said.append(lambda stage, peer, text: said.append(text))
        a, b = Replica("a", "x:1"), Replica("b", "x:2")
        assert standbys.choose([[a, b]], {"a", "b"}) == ["a"]

        async def refused() -> int:
            raise SwarmError("UNAVAILABLE: connection refused")

        for step in range(FAILED_ASKS):
            assert standbys.of("a") == 0
            standbys.nudge(a, refused(), step)
            await asyncio.sleep(0.01)
        assert standbys.of("a") is None
        assert said and said[0].startswith(
            f"standby a of stage 0 replaced: its last {FAILED_ASKS} asks for the stage's updates "
            "failed (UNAVAILABLE: connection refused)"
        ), said

    asyncio.run(run())


def test_an_ask_that_fails_in_an_unforeseen_way_is_logged_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # An ask that raised anything but a SwarmError (a bug of the client's, a decoding error)
    # ended its task with no line at any level, and counted toward no replacement: a standby
    # whose every ask failed so stood by for good, unsaid.
    async def run() -> None:
        standbys = _standbys()
        a, b = Replica("a", "x:1"), Replica("b", "x:2")
        assert standbys.choose([[a, b]], {"a", "b"}) == ["a"]

        async def broken() -> int:
            raise ValueError("an answer no one foresaw")

        for step in range(FAILED_ASKS):
            standbys.nudge(a, broken(), step)
            await asyncio.sleep(0.01)
        assert standbys.of("a") is None  # replaced, as one whose asks keep failing

    with caplog.at_level(logging.WARNING):
        asyncio.run(run())
    failed = [r for r in caplog.records if "an answer no one foresaw" in r.getMessage()]
    assert failed and failed[0].levelno >= logging.WARNING


def test_a_peer_behind_a_router_none_of_the_replicas_is_behind_stands_by_first() -> None:
    # One home's outage takes its router's peers together: c, alone behind home2, stands by,
    # though b is the slowest (and would be taken were the routers not known).
    routers = {"a": "home1", "b": "home1", "c": "home2"}
    members = [[Replica("a", "x:1", 5.0), Replica("b", "x:2", 1.0), Replica("c", "x:3", 3.0)]]
    blind = Standbys(1, lambda peer: HOSTS[peer])
    assert blind.choose(members, {"a", "b", "c"}) == ["b"]
    standbys = Standbys(1, lambda peer: HOSTS[peer], router=lambda peer: routers[peer])
    assert standbys.choose(members, {"a", "b", "c"}) == ["c"]


def test_a_standby_holding_no_copy_is_judged_as_steps_open_even_never_asked() -> None:
    # Chosen, then never asked as a copy (its Join does not answer: its own loop backs off),
    # or answering -1 for ever: holding no copy is behind too, bounded by COPY_STEPS.
    standbys, said = _standbys(), []
    standbys.said.append(lambda stage, peer, text: said.append(text))
    assert standbys.choose([[Replica("a", "x:1"), Replica("b", "x:2")]], {"a", "b"}) == ["a"]
    for step in range(1, COPY_STEPS):
        standbys.opened(step)
        standbys.opened(step)  # once a step, however often asked
    assert standbys.of("a") == 0
    assert standbys.words("a", COPY_STEPS - 1, "b") == (
        f"standby for stage 0: holds no copy yet as {COPY_STEPS - 1} steps opened (copying the "
        f"state of b; replaced at {COPY_STEPS})"
    )
    standbys.opened(COPY_STEPS)
    assert standbys.of("a") is None and "a" in standbys.passed_over
    assert said == [
        f"standby a of stage 0 replaced: it held no copy of the stage's state as {COPY_STEPS} "
        f"steps in a row opened (to step {COPY_STEPS}): its copy does not finish, or it does not "
        "answer; another peer of the stage stands by from the next step, if one may"
    ]


def test_a_copy_held_resets_the_count_and_a_stale_one_is_behind_from_its_step() -> None:
    standbys = _standbys()
    standbys.choose([[Replica("a", "x:1"), Replica("b", "x:2")]], {"a", "b"})
    for step in range(1, COPY_STEPS):
        standbys.opened(step)
    standbys.answered("a", COPY_STEPS - 1)  # its copy loaded just in time
    standbys.opened(COPY_STEPS)
    assert standbys.of("a") == 0
    # Its follow failed (it copies anew, -1): behind from the step it held, then replaced.
    standbys.answered("a", -1)
    for step in range(COPY_STEPS + 1, COPY_STEPS + LAG_BOUND + LAG_STEPS):
        standbys.opened(step)
    assert standbys.of("a") is None
    assert standbys.passed_over["a"].startswith(f"it was more than {LAG_BOUND} steps behind")


def test_a_standby_on_the_host_of_every_replica_now_is_replaced() -> None:
    # b stands by on h2 for a on h1. g joins on h2 and a leaves: the stage's only replica and
    # its standby share a host, whose outage takes both (before: b stood by on, unsaid, and
    # the stage did not count as short of a standby).
    standbys = _standbys()
    a, b, g = Replica("a", "x:1"), Replica("b", "x:2"), Replica("g", "x:7")
    assert standbys.choose([[a, b]], {"a"}) == [] and standbys.of("b") == 0
    assert standbys.choose([[a, b, g]], {"a", "g"}) == [] and standbys.of("b") == 0  # a stays
    standbys.choose([[b, g]], {"g"})
    assert standbys.of("b") is None and 0 in standbys.short
    assert "h2 now holds every replica" in standbys.passed_over["b"]
