"""A standby in the coordinator (issue 67): kept out of its stage's members from a step boundary
on, asked as each step opens, and promoted (no rollback) when its stage loses every replica; a
rollback when it is behind the step, naming why."""

from __future__ import annotations

import asyncio
from pathlib import Path

from swarm.job.fingerprint import fingerprint
from tests.support.coordinator import Harness, MakeHarness, job_of, until
from tests.support.replicas import FakeSwarm


async def _with_a_standby(tmp_path: Path, make_harness: MakeHarness) -> tuple[Harness, str, str]:
    """Stage 1 of two peers, one of them its standby after the first step: (harness, standby,
    replica)."""
    job = job_of(tmp_path, steps=6)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a")
    swarm.add(1, "b")
    swarm.add(1, "c")
    h = make_harness(job, swarm)
    h.coordinator.membership.standbys.wanted = 1
    await h.coordinator.start()
    await h.step()
    (standby,) = h.coordinator.membership.standbys.peers()
    replica = "c" if standby == "b" else "b"
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a"], [replica]]
    return h, standby, replica


async def test_a_standby_serves_nothing_and_is_promoted_when_its_stage_is_lost(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    h, standby, replica = await _with_a_standby(tmp_path, make_harness)
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
