"""A coordinator's start waits for the replicas that hold the job's recorded step, and believes no
replica past it (`scheduler.coordinator.holders`). After a restart of the scheduler (and of its
embedded broker) peers come back one by one over seconds: the start looked only at the peers
listed at that moment, so a stage whose first peer back was behind (restarted, mid-copy) rolled
every stage back to the last checkpoint, and a stage listed with every peer behind the store
rewound it silently. And a made-up id answering step 10^6 was the step every replica went to."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from swarm.job.fingerprint import fingerprint
from tests.support.coordinator import Harness, MakeHarness, job_of, until
from tests.support.replicas import FakeSwarm

GRACE_S = 30.0  # the scheduler's --lost-stage-grace-s, on the harness's fake clock


async def _trained_three_steps(tmp_path: Path, make_harness: MakeHarness) -> Path:
    """A job of 6 steps trained to step 3 by a (stage 0) and c (stage 1), its checkpoint of
    step 2 sealed; the coordinator then stops, as a scheduler does."""
    job = job_of(tmp_path, steps=6, checkpoint_every=2)
    first = FakeSwarm(fingerprint(job), 2)
    first.add(0, "a"), first.add(1, "c")
    h = make_harness(job, first, checkpoint_dir=tmp_path / "checkpoints")
    await h.coordinator.start()
    for _ in range(3):
        await h.step()
    await h.coordinator.close()
    return tmp_path / "checkpoints"


def _restarted(tmp_path: Path, make_harness: MakeHarness, checkpoints: Path) -> Harness:
    job = job_of(tmp_path, steps=6, checkpoint_every=2)
    return make_harness(job, FakeSwarm(fingerprint(job), 2), checkpoint_dir=checkpoints)


async def test_a_start_waits_for_the_holder_of_a_stage_listed_late_and_rolls_nothing_back(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    checkpoints = await _trained_three_steps(tmp_path, make_harness)
    h = _restarted(tmp_path, make_harness, checkpoints)
    b, c = h.swarm.add(0, "b", step=0), h.swarm.add(1, "c", step=3)  # b restarted empty
    starting = asyncio.create_task(h.coordinator.start(recorded=3, wait_s=GRACE_S))
    await until(lambda: b.called("info") and c.called("info"), "the first look")
    await asyncio.sleep(0.2)
    assert not starting.done(), "started (rolled back) without the holder of stage 0"
    a = h.swarm.add(0, "a", step=3)  # back on the bus a moment later
    assert await asyncio.wait_for(starting, 10) == 3
    assert a.called("load_state") == [] and c.called("load_state") == []
    assert h.rollbacks.empty()


async def test_a_start_whose_holder_never_comes_rolls_back_after_the_wait_and_says_why(
    tmp_path: Path, make_harness: MakeHarness, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoints = await _trained_three_steps(tmp_path, make_harness)
    h = _restarted(tmp_path, make_harness, checkpoints)
    b, c = h.swarm.add(0, "b", step=0), h.swarm.add(1, "c", step=3)
    caplog.set_level(logging.WARNING)
    starting = asyncio.create_task(h.coordinator.start(recorded=3, wait_s=GRACE_S))
    await until(lambda: any("step 3" in s for s in h.statuses), "the wait said")
    said = next(s for s in h.statuses if "step 3" in s)
    assert "stage 0" in said and "waiting" in said, said
    h.clock.advance(GRACE_S + 1)
    assert await asyncio.wait_for(starting, 10) == 2  # the checkpoint's step, as before
    assert b.called("load_state") == [2] and c.called("load_state") == [2]
    assert "no replica of stage 0 holds the job's recorded step 3" in caplog.text


async def test_a_start_whose_stages_all_fell_behind_the_store_says_the_steps_it_trains_again(
    tmp_path: Path, make_harness: MakeHarness, caplog: pytest.LogCaptureFixture
) -> None:
    job = job_of(tmp_path, steps=6)  # no checkpoint to go back to
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a", step=1), swarm.add(1, "c", step=1)
    h = make_harness(job, swarm)
    caplog.set_level(logging.WARNING)
    starting = asyncio.create_task(h.coordinator.start(recorded=3, wait_s=GRACE_S))
    await until(lambda: h.statuses, "the wait said")
    h.clock.advance(GRACE_S + 1)
    assert await asyncio.wait_for(starting, 10) == 1
    # was silent: the store rewound, steps 1 and 2 trained again with no word
    assert "steps 1..2 are trained again" in caplog.text, caplog.text


async def test_a_replica_past_the_recorded_step_is_not_believed(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path, steps=6)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a", step=3), swarm.add(1, "c", step=3)
    swarm.add(0, "liar", step=10**6)  # any token holder may announce an id and answer this
    h = make_harness(job, swarm)
    assert await h.coordinator.start(recorded=3, wait_s=GRACE_S) == 3  # was 10**6: job "done"
    assert [r.peer for r in h.coordinator.replicas()[0]] == ["a"]


async def test_replicas_two_steps_past_the_record_are_believed(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """The next step opens before a step's record is written, and may be applied meanwhile: a
    scheduler stopped then leaves every replica two steps past the store."""
    job = job_of(tmp_path, steps=6)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, c = swarm.add(0, "a", step=5), swarm.add(1, "c", step=5)
    h = make_harness(job, swarm)
    assert await h.coordinator.start(recorded=3, wait_s=0.0) == 5
    assert a.called("load_state") == [] and c.called("load_state") == []
