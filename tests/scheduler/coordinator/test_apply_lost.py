"""An APPLY lost on its way (the relay a replica is reached through died with it, and the replica
re-attached to another) is sent again over the path the replica is reached by now, a bounded
number of times: a stage whose only replica missed its APPLY would otherwise be a step behind,
left out at the next commit, and the whole job rolled back to a checkpoint while a path to it
existed (CI, stop 77: tests/system/test_relay_failover.py). APPLY is idempotent at the replica
(one that applied the step answers that it already had), so one whose answer was lost is not
applied twice. In-memory replicas (`tests.support.replicas`)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from scheduler.coordinator.apply_again import ApplyAgain
from swarm.errors import DeadlineExceeded, PeerUnavailable
from swarm.job.fingerprint import fingerprint
from tests.support.coordinator import MakeHarness, job_of, until
from tests.support.jobs import make_job
from tests.support.replicas import FakeSwarm

pytestmark = pytest.mark.timeout(60)

_LOST = "UNAVAILABLE: Socket closed (the relay it was reached through is gone)"


async def test_an_apply_lost_on_its_way_is_sent_again_and_nothing_rolls_back(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path, steps=3)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, c = swarm.add(0, "a"), swarm.add(1, "c")  # c: stage 1's only replica
    c.fail("apply", PeerUnavailable(_LOST))  # before it reached c: c is still at step 0
    h = make_harness(job, swarm)
    await h.coordinator.start()
    records = [await h.step() for _ in range(3)]
    assert [r.step for r in records] == [0, 1, 2]
    assert c.called("apply") == [0, 0, 1, 2]  # step 0's, sent again
    assert (a.step, c.step) == (3, 3)
    assert h.rollbacks.empty() and h.coordinator.error is None


async def test_an_apply_whose_answer_was_lost_is_not_applied_twice(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """The APPLY reached c and applied; its answer did not come back. Sent again, c answers that
    it had applied the step: one optimizer step, not two."""
    job = job_of(tmp_path, steps=2)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, c = swarm.add(0, "a"), swarm.add(1, "c")
    applied = c.apply
    answers_lost = [PeerUnavailable(_LOST)]

    async def apply_then_lose_the_answer(step: int, scale: float = 1.0) -> None:
        await applied(step, scale)
        if answers_lost:
            raise answers_lost.pop()

    c.apply = apply_then_lose_the_answer  # type: ignore[method-assign]
    h = make_harness(job, swarm)
    await h.coordinator.start()
    records = [await h.step() for _ in range(2)]
    assert [r.step for r in records] == [0, 1]
    assert c.called("apply") == [0, 0, 1] and c.scales == [1.0, 1.0]  # applied once each
    assert (a.step, c.step) == (2, 2)
    assert h.rollbacks.empty() and h.coordinator.error is None


async def test_a_lost_apply_is_sent_again_a_bounded_number_of_times_and_said(
    tmp_path: Path, make_harness: MakeHarness, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica that never answers again: its APPLY is sent `tries` times in all, each loss
    said with its cause, and then it is left to the next commit as before."""
    job = job_of(tmp_path, steps=2)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a"), swarm.add(1, "c")
    c = swarm["c"]
    c.fail("apply", *(PeerUnavailable(_LOST) for _ in range(3)))
    h = make_harness(job, swarm)
    h.coordinator.two_phase.apply_again = ApplyAgain(tries=3, first_s=0.001, cap_s=0.001)
    await h.coordinator.start()
    caplog.set_level(logging.WARNING, "scheduler.coordinator.apply_again")
    assert (await h.step()).step == 0
    assert c.called("apply") == [0, 0, 0] and c.step == 0
    said = caplog.text
    assert "apply on c (stage 1) got no answer: UNAVAILABLE: Socket closed" in said
    assert "apply on c (stage 1) failed 3 times, the last: UNAVAILABLE: Socket closed" in said


@pytest.mark.parametrize("why", ["another applied", "unlisted", "deadline"])
async def test_an_apply_is_not_sent_again_where_it_would_not_help(
    tmp_path: Path, make_harness: MakeHarness, why: str
) -> None:
    """Not where another replica of the stage applied (c copies it at the next step), not to a
    peer the registry no longer lists, and not after a deadline (it may be applying still)."""
    job = job_of(tmp_path, steps=2)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a"), swarm.add(1, "c")
    if why == "another applied":
        swarm.add(1, "d")
    c = swarm["c"]
    error = DeadlineExceeded("DEADLINE_EXCEEDED") if why == "deadline" else PeerUnavailable(_LOST)

    async def lost(step: int, scale: float = 1.0) -> None:
        if why == "unlisted":
            swarm.remove("c")  # its heartbeats stopped: the registry left it out
        c.calls.append(("apply", step))
        raise error

    c.apply = lost  # type: ignore[method-assign]
    h = make_harness(job, swarm)
    h.coordinator.two_phase.apply_again = ApplyAgain(tries=3, first_s=0.001, cap_s=0.001)
    await h.coordinator.start()
    for task in await h.lease():
        await h.run(task, {0: "a", 1: "c"})
    await until(lambda: c.called("apply"))
    await asyncio.sleep(0.05)  # a second try would have gone by now
    assert c.called("apply") == [0]


async def test_a_rounds_lost_apply_is_sent_again(tmp_path: Path, make_harness: MakeHarness) -> None:
    """pool.mode = "local": the APPLY of a round's end, lost on its way to its stage's only
    replica, is sent again as a step's is."""
    training = {"stages": 2, "microbatch_size": 4, "target_batch_size": 8, "steps": 4}
    job = make_job(tmp_path, training=training, pool={"mode": "local", "sync_every": 2})
    swarm = FakeSwarm(fingerprint(job), 2)
    a, c = swarm.add(0, "a"), swarm.add(1, "c")
    c.fail("apply_round", PeerUnavailable(_LOST))
    h = make_harness(job, swarm)
    h.coordinator.rounds.apply_again = ApplyAgain(tries=3, first_s=0.001, cap_s=0.001)
    await h.coordinator.start()
    records = [await h.step() for _ in range(4)]
    assert [r.step for r in records] == [0, 1, 2, 3]
    assert c.called("apply_round") == [2, 2, 4] and a.called("apply_round") == [2, 4]
    assert h.rollbacks.empty() and h.coordinator.error is None
