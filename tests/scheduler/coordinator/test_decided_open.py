"""The plain synchronous rule opens step t+1 once step t is decided (every PREPARE answered, the
APPLYs sent), not once every APPLY answered (issue 69): the next step's lease and first push run
beside the APPLYs. Step t stays live until they answered: step t+1's commit waits for them, and
the last step (whose final evaluation is of the trained model) and the rules with rounds open
nothing early. In-memory replicas (`tests.support.replicas`); a replica's own wait for its APPLY
is tests/stage_server/replica/test_pending_apply.py's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from swarm.job.fingerprint import fingerprint
from swarm.rpc.lease import MicrobatchResult
from tests.support.coordinator import Harness, MakeHarness, job_of, until
from tests.support.jobs import make_job
from tests.support.replicas import FakeReplica, FakeSwarm, Gate

pytestmark = pytest.mark.timeout(60)


async def _c_applying(h: Harness, a: FakeReplica, c: FakeReplica, step: int) -> Gate:
    """`step` trained and decided: a applied it, c's APPLY of it is held (returned)."""
    applying = c.hold("apply")
    for task in await h.lease():
        await h.run(task)
    await asyncio.wait_for(applying.entered.wait(), 10)
    await until(lambda: a.step == step + 1)
    return applying


async def test_the_next_step_is_leased_while_the_applies_are_answered(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path, steps=5)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, c = swarm.add(0, "a"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    await h.coordinator.start()
    applied = c.apply

    async def apply_then_compute(step: int, scale: float = 1.0) -> None:
        await applied(step, scale)
        if step == 0:  # step 1's work reached c before its APPLY, and waited for it there
            c.receipts.update({0, 1})

    c.apply = apply_then_compute  # type: ignore[method-assign]
    applying = await _c_applying(h, a, c, 0)  # on its way until the test lets it go
    # Before: no work until every APPLY answered (the lease came back empty).
    lease = await h.coordinator.lease("t", 8)
    assert {(t.step, t.index) for t in lease.tasks} == {(1, 0), (1, 1)}
    for task in lease.tasks:  # step 1 completes while c's APPLY of step 0 is still held
        a.accumulate(task.index)
        await h.coordinator.report("t", MicrobatchResult(1, task.index, {0: "a", 1: "c"}, 1.0, 4))
    await asyncio.sleep(0.05)  # its commit waits for step 0's APPLY: no PREPARE of step 1
    assert h.steps.empty() and not [p for p in a.called("prepare") if p.step == 1]
    applying.open()
    records = [await asyncio.wait_for(h.steps.get(), 10) for _ in range(2)]
    assert [r.step for r in records] == [0, 1]  # in order, each committed once
    assert (a.step, c.step) == (2, 2) and c.called("apply") == [0, 1]
    assert h.rollbacks.empty() and h.coordinator.error is None


async def test_the_last_step_opens_nothing_before_its_applies_answered(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """The job ends (the final evaluation opens, or nothing) only once the last step is applied
    everywhere: the trained model is gathered after it."""
    job = job_of(tmp_path, steps=2)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, c = swarm.add(0, "a"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    await h.coordinator.start()
    await h.step()
    applying = await _c_applying(h, a, c, 1)
    lease = await h.coordinator.lease("t", 8)
    assert not lease.tasks and not lease.done and not h.coordinator.finished.is_set()
    applying.open()
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 1
    await asyncio.wait_for(h.coordinator.finished.wait(), 10)
    assert (a.step, c.step) == (2, 2)


async def test_a_rule_with_rounds_opens_the_next_step_once_applied(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """pool.mode = "local": a round's end follows its last step's APPLY within the commit, so
    the next step opens after it, as before."""
    training = {"stages": 2, "microbatch_size": 4, "target_batch_size": 8, "steps": 4}
    job = make_job(tmp_path, training=training, pool={"mode": "local", "sync_every": 2})
    swarm = FakeSwarm(fingerprint(job), 2)
    a, c = swarm.add(0, "a"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    await h.coordinator.start()
    applying = await _c_applying(h, a, c, 0)
    assert not (await h.coordinator.lease("t", 8)).tasks
    applying.open()
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 0
    assert {t.step for t in await h.lease()} == {1}
