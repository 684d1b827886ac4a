"""A standby in the coordinator (issue 67): kept out of its stage's members from a step boundary
on, asked as each step opens, and promoted (no rollback) when its stage loses every replica; a
rollback when it is behind the step, naming why."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from scheduler.coordinator import unlisted
from scheduler.coordinator.standbys import COPY_STEPS, LAG_BOUND, LAG_STEPS
from swarm.errors import PeerUnavailable
from swarm.job.fingerprint import fingerprint
from tests.support.coordinator import Harness, MakeHarness, job_of, until
from tests.support.replicas import FakeSwarm


async def _with_a_standby(
    tmp_path: Path, make_harness: MakeHarness, only_spares: bool = False, steps: int = 6
) -> tuple[Harness, str, str]:
    """Stage 1 of two peers, one of them its standby after the first step: (harness, standby,
    replica). `only_spares`: the default's standby ("auto"): stage 0 has one peer, so stage 1
    has one to spare (no speeds known: each peer counts as one)."""
    job = job_of(tmp_path, steps=steps)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a")
    swarm.add(1, "b")
    swarm.add(1, "c")
    h = make_harness(job, swarm)
    h.coordinator.membership.standbys.wanted = 1
    h.coordinator.membership.standbys.only_spares = only_spares
    await h.coordinator.start()
    await h.step()
    (standby,) = h.coordinator.membership.standbys.peers()
    replica = "c" if standby == "b" else "b"
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a"], [replica]]
    return h, standby, replica


@pytest.mark.parametrize("only_spares", [False, True])
async def test_a_standby_serves_nothing_and_is_promoted_when_its_stage_is_lost(
    tmp_path: Path, make_harness: MakeHarness, only_spares: bool
) -> None:
    h, standby, replica = await _with_a_standby(tmp_path, make_harness, only_spares)
    promoted: list[tuple[int, int, str]] = []
    h.coordinator.membership.standbys.promoted.append(lambda *told: promoted.append(told))
    await h.step()  # it copies a member, and is asked again as the next step opens
    waits = h.coordinator.membership.waits()
    await until(lambda: h.swarm[standby].step == 2, "the standby at the open step")
    await until(
        lambda: "0 steps behind" in h.coordinator.membership.waits().get(standby, ""),
        f"status saying the standby is at the step (it said {waits})",
    )
    h.swarm.remove(replica)  # every replica of stage 1 is gone
    tasks = await h.lease()
    assert {t.step for t in tasks} == {2} and h.rollbacks.empty()
    assert promoted == [(2, 1, standby)]
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a"], [standby]]
    for task in tasks:
        await h.run(task)
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 2  # training goes on
    assert h.rollbacks.empty()


async def test_a_standby_behind_the_step_is_not_promoted_and_the_rollback_says_why(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    h, standby, replica = await _with_a_standby(tmp_path, make_harness)
    h.swarm[standby].copying = 1_000_000  # its copy never reaches the source from now on
    await h.step()
    h.swarm.remove(replica)
    h.swarm.add(1, "fresh")  # a peer that can serve the stage, with none of its state
    await h.coordinator.lease("t", 8)
    # No checkpoint: to step 0, whose state is built anew (seconds on a busy machine).
    assert await asyncio.wait_for(h.rollbacks.get(), 60) == 0
    missed = h.coordinator.membership.standbys.missed
    assert missed == (
        f"stage 1's standby {standby} was at step 1, not 2: the updates it lacked were lost "
        "with the stage"
    )


async def test_where_the_swarm_has_no_room_the_default_takes_no_replica(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    # The default ("auto"): two stages of two peers each need every one of them; none stands
    # by, and all four serve, as without standbys.
    job = job_of(tmp_path, steps=4)
    swarm = FakeSwarm(fingerprint(job), 2)
    for stage, peer in ((0, "a"), (0, "b"), (1, "c"), (1, "d")):
        swarm.add(stage, peer)
    h = make_harness(job, swarm)
    h.coordinator.membership.standbys.wanted = 1
    h.coordinator.membership.standbys.only_spares = True
    await h.coordinator.start()
    await h.step()
    await h.step()
    assert h.coordinator.membership.standbys.peers() == set()
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a", "b"], ["c", "d"]]


async def test_a_standby_that_falls_behind_is_replaced_and_serves_once_it_caught_up(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    h, standby, _ = await _with_a_standby(tmp_path, make_harness, steps=12)
    said: list[str] = []
    h.coordinator.membership.standbys.said.append(lambda stage, peer, text: said.append(text))
    await h.step()
    await until(lambda: h.swarm[standby].step == 2, "the standby at the open step")
    h.swarm[standby].copying = 1_000_000  # it copies anew from now on, never done: behind
    for _ in range(LAG_BOUND + LAG_STEPS + 1):
        await h.step()  # the pool never waits for it
    assert h.coordinator.membership.standbys.of(standby) is None
    assert said and said[0].startswith(f"standby {standby} of stage 1 replaced: it was more "), said
    waits = h.coordinator.membership.waits()  # status says so too, with why, until it joins
    assert waits[standby].startswith("replaced as standby (it was more than 2 steps "), waits
    # An ordinary peer of its stage now: once its copy is done it joins as any joiner does.
    h.swarm[standby].copying = 0
    await h.step()
    await until(lambda: standby in h.coordinator.membership.synced, "the replaced standby admitted")
    assert h.coordinator.membership.standbys.peers() == set()  # no other peer may stand by


async def test_a_standby_that_never_holds_a_copy_is_replaced(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    # The soak's peer6: stopped as a member, it came back holding an old step and was chosen
    # standby, but its copy never loaded (its Join answered -1 every time). Never having held
    # a copy, it had no lag, so it was kept until its stage was killed, and the job rolled
    # back (it was at step 61, not 344). Holding none is behind too: bounded, then replaced.
    job = job_of(tmp_path, steps=COPY_STEPS + 8)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a")
    swarm.add(1, "b")
    swarm.add(1, "c")
    for peer in ("b", "c"):  # whichever stands by copies for ever (a member is never asked)
        swarm[peer].copying = 1_000_000
    h = make_harness(job, swarm)
    h.coordinator.membership.standbys.wanted = 1
    said: list[str] = []
    h.coordinator.membership.standbys.said.append(lambda stage, peer, text: said.append(text))
    await h.coordinator.start()
    await h.step()
    (standby,) = h.coordinator.membership.standbys.peers()
    await h.step()
    waits = h.coordinator.membership.waits()  # status: it holds nothing yet, not "0 behind"
    assert waits[standby].startswith("standby for stage 1: holds no copy yet as "), waits
    for _ in range(COPY_STEPS):
        await h.step()  # the pool never waits for it
    assert h.coordinator.membership.standbys.of(standby) is None, "kept, holding no copy"
    assert said and said[0].startswith(
        f"standby {standby} of stage 1 replaced: it held no copy of the stage's state as "
        f"{COPY_STEPS} steps in a row opened"
    ), said
    waits = h.coordinator.membership.waits()
    assert waits[standby].startswith("replaced as standby (it held no copy "), waits


@pytest.mark.parametrize("case", ["answers", "across a boundary", "past the grace", "stopped"])
async def test_a_replica_unlisted_but_answering_keeps_its_stage(
    tmp_path: Path, make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    # The registry no longer lists stage 1's replica (its last-will fired as the broker
    # restarted), but it answers at the step on the data plane: the stage is not lost, so its
    # standby is not promoted and nothing rolls back; listed again, the replica serves on. One
    # unlisted past the grace (here at once) serves nobody, and one that does not answer in
    # time (SIGSTOPped) holds nothing up: the standby is promoted then. Across a step boundary
    # (the soak's: another stage's opened meanwhile) the replica is no member when listed again,
    # but it is re-admitted at the step, and its standby still stands by.
    if case == "past the grace":
        monkeypatch.setattr(unlisted, "GRACE_S", -1.0)
    monkeypatch.setattr(unlisted, "ASK_TIMEOUT_S", 0.05)
    h, standby, replica = await _with_a_standby(tmp_path, make_harness)
    promoted: list[tuple[int, int, str]] = []
    h.coordinator.membership.standbys.promoted.append(lambda *told: promoted.append(told))
    await h.step()
    await until(lambda: h.swarm[standby].step == 2, "the standby at the open step")
    kept = h.swarm[replica]
    h.swarm.stages[1].remove(kept)  # unlisted, alive
    if case == "stopped":
        kept.hold("info")  # never opened: it answers no more, nor fails
    await h.coordinator.lease("t", 8)  # no member of stage 1: the coordinator looks, at once
    await until(lambda: not h.coordinator._rollback.running, "the look over")
    assert h.rollbacks.empty()
    if case in ("past the grace", "stopped"):
        assert promoted == [(2, 1, standby)]
        return
    assert promoted == []
    if case == "across a boundary":
        await h.coordinator.membership.sync(2)  # it left the members there
        h.clock.advance(1.0)  # past the last look's backoff: the coordinator looks again
    h.swarm.stages[1].append(kept)  # listed again: its bus reconnected
    tasks = await h.lease()
    assert {t.step for t in tasks} == {2}
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a"], [replica]]
    for task in tasks:
        await h.run(task)
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 2  # training goes on
    assert h.rollbacks.empty() and promoted == []


async def test_a_standby_that_was_a_member_is_not_promoted_while_its_stage_has_one(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    # The 6-minute soak's second broker restart: stage 1's only replica (peer4) was unlisted,
    # which had the coordinator look for a stage's loss, and stage 0's standby (peer3) was
    # promoted in the same look though stage 0 still had a member (peer6). peer3 had been a
    # member of stage 0 before the stage kill: it left, came back and stood by, and a former
    # member left out is looked at on every stage, its own stage's members or not. A standby
    # is promoted only where its stage has no member.
    job = job_of(tmp_path, steps=10)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a")
    swarm.add(0, "d")
    swarm.add(1, "b")
    swarm.add(1, "c")
    h = make_harness(job, swarm)
    membership = h.coordinator.membership
    await h.coordinator.start()
    await h.step()
    left = h.swarm["b"]
    h.swarm.stages[1].remove(left)  # it leaves stage 1 (alive: a moment off its bus)
    await h.step()
    assert "b" not in membership.synced
    h.swarm.stages[1].append(left)  # back: a joiner, so it stands by first
    membership.standbys.wanted = 1
    await h.step()
    assert membership.standbys.of("b") == 1
    (ours,) = [p for p in membership.standbys.peers() if membership.standbys.of(p) == 0]
    replica = "d" if ours == "a" else "a"
    promoted: list[tuple[int, int, str]] = []
    membership.standbys.promoted.append(lambda *told: promoted.append(told))
    await h.step()
    step = next(ledger.step for ledger in membership.ledgers())
    await until(lambda: h.swarm["b"].step == step, "stage 1's standby at the open step")
    await until(lambda: h.swarm[ours].step == step, "stage 0's standby at the open step")
    h.swarm.remove(replica)  # stage 0 is lost whole: its standby is promoted
    tasks = await h.lease()
    assert {t.step for t in tasks} == {step} and h.rollbacks.empty()
    assert promoted == [(step, 0, ours)], "a standby promoted on a stage that has a member"
    assert membership.standbys.of("b") == 1
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [[ours], ["c"]]


async def test_a_standby_that_missed_a_rollback_is_not_promoted_when_training_is_back_at_its_step(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    # The standby at step 2 misses a rollback's LoadState (to step 0), and its next Joins find
    # its new copy downloading, never done: it holds step 2's state from before the rollback.
    # Training comes back to step 2 and the stage's replica dies there. A real replica's Info
    # said the epoch of its last Join, the rollback's, and the standby was promoted with the
    # state rolled back (`tests/stage_server/replica/test_rollback_epoch.py`); it says its
    # state's, and the stage is rolled back again.
    h, standby, replica = await _with_a_standby(tmp_path, make_harness, steps=8)
    held = h.swarm[standby]
    await h.step()
    await until(lambda: held.step == 2, "the standby at the open step")
    held.fail("load_state", PeerUnavailable("UNAVAILABLE: deadline exceeded"))
    held.copying = 1_000_000
    before = held.state_epoch
    h.coordinator.bans.roll_back_to(0)
    assert await asyncio.wait_for(h.rollbacks.get(), 60) == 0
    await h.step()
    await h.step()
    await until(lambda: len(held.called("join")) > 2, "the standby asked to Join anew")
    assert held.step == 2 and held.epoch > before == held.state_epoch
    # what it holds is of the trajectory rolled back: status said "0 steps behind" (its last
    # copy's step kept), and the bound on a standby holding no copy never applied (a review)
    waits = h.coordinator.membership.waits()
    assert waits[standby].startswith("standby for stage 1: holds no copy yet"), waits
    promoted: list[tuple[int, int, str]] = []
    h.coordinator.membership.standbys.promoted.append(lambda *told: promoted.append(told))
    h.swarm.remove(replica)
    await h.coordinator.lease("t", 8)
    assert await asyncio.wait_for(h.rollbacks.get(), 60) == 0
    assert promoted == []
