"""The step coordinator against in-memory replicas (`tests.support.replicas`): the two-phase
commit, voids, joins and rollback, each interleaving fixed by the test (gates on the replicas'
calls, a `FakeClock` for leases and backoff)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from swarm.errors import Aborted, PeerUnavailable
from swarm.job.fingerprint import fingerprint
from swarm.model import checkpoint
from swarm.model.stage_state import initial_state
from swarm.ops.progress import StepRecord
from swarm.rpc.lease import Task
from tests.support.coordinator import LEASE_S, Harness, MakeHarness, job_of, until
from tests.support.disks import fill, tiny_disk
from tests.support.replicas import FakeReplica, FakeSwarm, Prepared
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


async def test_commit_prepares_every_replica_then_applies_and_opens_the_next_step(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, b, c = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    assert await h.coordinator.start() == 0
    tasks = await h.lease()
    assert tasks == [Task(0, 0, frozenset({0, 1})), Task(0, 1, frozenset({0, 1}))]
    # Where the step is, in words (a stall's message says it)
    assert h.coordinator.progress() == (
        "step 0 waits for 2 of its 2 microbatches (1 trainer(s) hold leases on them)"
    )
    await h.run(tasks[0], {0: "a"})
    await h.run(tasks[1], {0: "b"})
    record = await asyncio.wait_for(h.steps.get(), 10)
    assert (record.step, record.samples, record.loss) == (0, 8, 2.0 / 8)

    group0 = ["fake:a", "fake:b"]
    assert a.called("prepare") == [Prepared(0, [0], 8, group0, 0, "0/0")]
    assert b.called("prepare") == [Prepared(0, [1], 8, group0, 1, "0/0")]
    assert c.called("prepare") == [Prepared(0, [0, 1], 8, ["fake:c"], 0, "0/0")]
    phases = [method for _, method in swarm.log if method in ("prepare", "apply")]
    assert phases == ["prepare"] * 3 + ["apply"] * 3  # no APPLY before every PREPARE succeeded
    assert all(r.called("apply") == [0] and r.step == 1 for r in (a, b, c))
    assert h.coordinator.ledger is not None and h.coordinator.ledger.step == 1
    assert {t.step for t in await h.lease()} == {1}


async def test_receipts_beyond_the_ledger_void_the_replica_before_prepare(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, b, c = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    await h.coordinator.start()
    first, _ = await h.lease()
    await h.run(first, {0: "a"})
    a.accumulate(1)  # the trainer ran microbatch 1 on a, then went silent without reporting
    h.clock.advance(LEASE_S + 1)  # its lease ran out: the step is suspect
    (again,) = await h.lease("u")
    assert again == Task(0, 1, frozenset({0, 1}))
    await h.run(again, {0: "b"}, trainer="u")
    # Info shows a holding [0, 1] where the ledger accepted [0]: a is voided, nobody prepares,
    # and microbatch 0 is needed again at stage 0 only.
    assert await h.lease("u") == [Task(0, 0, frozenset({0}))]
    assert a.called("discard") == [0] and not a.receipts
    assert not any(r.called("prepare") for r in (a, b, c))
    await h.run(Task(0, 0, frozenset({0})), {0: "b"}, trainer="u")
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 0
    assert a.called("prepare")[-1].microbatches == []
    assert b.called("prepare")[-1].microbatches == [0, 1]
    assert c.called("prepare")[-1].microbatches == [0, 1]


async def test_a_clean_step_goes_straight_to_prepare_which_refuses_an_unknown_receipt(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """Nothing suspect happened in the step (no lease ran out, nothing given back or left out):
    its commit asks no replica for its receipts first, one round trip less. A receipt the
    ledger does not know of all the same is refused by PREPARE's own check: that replica is
    voided, its microbatches replayed, and the step commits with exactly the ledger's."""
    job = job_of(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, b, c = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    await h.coordinator.start()  # (which asks every replica where it stands)
    looked = [len(r.called("info")) for r in (a, b, c)]
    await h.step({0: "a"})
    assert [len(r.called("info")) for r in (a, b, c)] == looked  # clean: no look first
    first, second = await h.lease()
    await h.run(first, {0: "a"})
    a.accumulate(1)  # a receipt no ledger event explains
    await h.run(second, {0: "b"})
    assert await h.lease() == [Task(1, 0, frozenset({0}))]
    assert a.called("prepare")[-1].microbatches == [0]  # it refused: it holds [0, 1]
    assert not any(r.called("apply")[1:] for r in (a, b, c))  # nothing applied
    assert a.called("discard") == [1] and not a.receipts
    await h.run(Task(1, 0, frozenset({0})), {0: "b"})
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 1
    assert b.called("prepare")[-1].microbatches == [0, 1]
    assert a.called("prepare")[-1].microbatches == []
    assert len(a.called("info")) > looked[0]  # the retry looked first
    assert (a.step, b.step, c.step) == (2, 2, 2)


async def test_a_replica_gone_during_prepare_is_dropped_and_the_step_commits_after_replay(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, b, c = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    a.fail("prepare", PeerUnavailable("UNAVAILABLE: connection refused"))
    h = make_harness(job, swarm)
    await h.coordinator.start()
    first, second = await h.lease()
    await h.run(first, {0: "a"})
    await h.run(second, {0: "b"})
    replay = await h.lease()
    assert replay == [Task(0, 0, frozenset({0}))]  # a's microbatch, at a's stage only
    assert [r.peer for r in h.coordinator.replicas()[0]] == ["b"]
    await h.run(replay[0], {0: "b"})
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 0
    assert b.called("prepare")[-1] == Prepared(0, [0, 1], 8, ["fake:b"], 0, "0/1")
    assert c.called("prepare")[-1].round == "0/1"
    assert a.called("apply") == [] and (b.step, c.step) == (1, 1)


async def test_an_aborted_round_is_retried_under_a_new_round_id(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, b, c = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    b.fail("prepare", Aborted("round 0/0: a member did not send its part"))
    h = make_harness(job, swarm)
    await h.coordinator.start()
    first, second = await h.lease()
    await h.run(first, {0: "a"})
    await h.run(second, {0: "b"})
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 0  # by itself: nothing was lost
    assert [p.round for p in b.called("prepare")] == ["0/0", "0/1"]
    assert a.called("prepare")[1] == Prepared(0, [0], 8, ["fake:a", "fake:b"], 0, "0/1")
    assert not any(r.called("discard") for r in (a, b, c))  # Aborted voids nobody


async def test_a_joiner_copies_a_member_at_the_boundary_and_one_that_fails_backs_off(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path, steps=5)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    await h.coordinator.start()
    n, m = swarm.add(0, "n"), swarm.add(1, "m")  # appear during step 0
    m.fail("join", PeerUnavailable("UNAVAILABLE: m is not listening yet"))
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a"], ["c"]]
    await h.step()
    # from the boundary on, in the background: n copied a (step 1) and is a member; m failed
    await until(lambda: len(h.coordinator.replicas()[0]) == 2)
    assert n.called("join") == ["fake:a"] and n.step == 1
    assert m.called("join") == ["fake:c"]
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a", "n"], ["c"]]
    await h.step(at={0: "n"})
    assert n.called("prepare")[-1] == Prepared(1, [0, 1], 8, ["fake:a", "fake:n"], 1, "1/0")
    assert len(m.called("join")) == 1  # still backing off: no try at this boundary
    h.clock.advance(60)
    await h.step()
    await until(lambda: len(h.coordinator.replicas()[1]) == 2)
    assert len(m.called("join")) == 2 and m.step == 3
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a", "n"], ["c", "m"]]
    # a peer that left: forgotten at the next boundary, its connection closed
    swarm.remove("n")
    h.coordinator.clients.grace_s = 0.0  # closed once its calls in flight had their time: now
    await h.step()
    await asyncio.sleep(0.01)
    assert n.closed == 1 and len(h.coordinator.clients) == 3


async def test_a_lost_stage_rolls_every_stage_back_to_the_last_checkpoint(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path, steps=5, checkpoint_every=2)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, c = swarm.add(0, "a"), swarm.add(1, "c")
    h = make_harness(job, swarm, checkpoint_dir=tmp_path / "checkpoints")
    await h.coordinator.start()
    for _ in range(3):
        await h.step()
    assert (a.step, c.step) == (3, 3)
    swarm.remove("c")  # stage 1 lost its only replica; d comes up empty
    d = swarm.add(1, "d")
    assert (await h.coordinator.lease("t", 8)).tasks == []  # no work: a stage has no member
    assert await asyncio.wait_for(h.rollbacks.get(), 10) == 2
    assert a.called("load_state") == [2] and d.called("load_state") == [2]
    assert torch.equal(a.state["w"], torch.tensor([2.0])) and d.state["w"].item() == 2.0
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a"], ["d"]]
    tasks = await h.lease()
    assert {t.step for t in tasks} == {2}  # data position included: step 2's microbatches
    for task in tasks:
        await h.run(task)
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 2


async def test_without_a_checkpoint_a_rollback_goes_to_step_0s_initial_state(
    tmp_path: Path, make_harness: MakeHarness, caplog: pytest.LogCaptureFixture
) -> None:
    job = job_of(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, _ = swarm.add(0, "a"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    await h.coordinator.start()
    await h.step()
    swarm.remove("c")
    d = swarm.add(1, "d")
    await h.coordinator.lease("t", 8)
    assert await asyncio.wait_for(h.rollbacks.get(), 10) == 0
    for replica, stage in ((a, 0), (d, 1)):
        expected = initial_state(job, stage)
        assert replica.step == 0 and replica.state.keys() == expected.keys()
        assert all(torch.equal(replica.state[k], v) for k, v in expected.items())
    assert h.coordinator.ledger is not None and h.coordinator.ledger.step == 0
    loud = [r for r in caplog.records if r.levelname == "WARNING" and "step 0" in r.message]
    assert any("no checkpoint" in r.message for r in loud)  # all training lost: said loudly


async def _a_straggler_and_b(
    tmp_path: Path, make_harness: MakeHarness
) -> tuple[Harness, FakeReplica, FakeReplica, FakeReplica, Task, Task]:
    """p and q at stage 0, c at stage 1. Trainer A leases microbatch 0 and is slow: its lease
    expires and B leases both microbatches (returned)."""
    job = job_of(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    p, q, c = swarm.add(0, "p"), swarm.add(0, "q"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    await h.coordinator.start()
    assert await h.lease("A", 1) == [Task(0, 0, frozenset({0, 1}))]
    h.clock.advance(LEASE_S + 1)
    first, second = await h.lease("B", 2)
    return h, p, q, c, first, second


async def test_a_void_landing_while_the_commit_gathers_receipts_stops_the_prepare(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    h, p, q, c, first, second = await _a_straggler_and_b(tmp_path, make_harness)
    straggler = await h.run(first, {0: "p"}, trainer="A", report=False)
    gathering = p.hold("info")
    await h.run(first, {0: "q"}, trainer="B")
    await h.run(second, {0: "p"}, trainer="B")  # the ledger is complete: the commit starts
    await asyncio.wait_for(gathering.entered.wait(), 10)
    # While the receipts are gathered, A reports microbatch 0 at stage 0 on p, where q's was
    # accepted. A's lease went to B: its word is not taken (it voids no one by itself), but
    # p's receipts, now read, show microbatch 0 beside its 1: p holds one the ledger does not,
    # is voided (its microbatch 1 is needed again at stage 0) and discards all.
    await h.coordinator.report("A", straggler)
    assert not p.called("discard")
    gathering.open()
    await wait_until(lambda: p.called("discard") == [0] and not p.receipts, "p voided")
    assert await h.lease("B", 2) == [Task(0, 1, frozenset({0}))]
    assert not any(r.called("prepare") for r in (p, q, c))  # not on an incomplete ledger
    await h.run(Task(0, 1, frozenset({0})), {0: "q"}, trainer="B")
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 0
    assert q.called("prepare") == [Prepared(0, [0, 1], 8, ["fake:p", "fake:q"], 1, "0/1")]
    assert p.called("prepare")[-1].microbatches == []


async def test_a_duplicate_reported_while_apply_runs_leaves_the_replica_in_the_commit(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    h, p, q, c, first, second = await _a_straggler_and_b(tmp_path, make_harness)
    applying = p.hold("apply")
    await h.run(first, {0: "q"}, trainer="B")
    await h.run(second, {0: "p"}, trainer="B")  # complete: p and q prepare, then apply
    await asyncio.wait_for(applying.entered.wait(), 10)
    # Only now does A's microbatch 0 land on p, after p prepared (its sums are a copy taken
    # then), and A reports it. Voiding p now would wipe what it prepared: its APPLY would fail
    # and p would be dropped from a step that commits whole all the same.
    await h.run(first, {0: "p"}, trainer="A")
    assert not p.called("discard")
    applying.open()
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 0
    assert (p.step, q.step, c.step) == (1, 1, 1)
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["p", "q"], ["c"]]
    assert {(t.step, t.index) for t in await h.lease("B", 2)} == {(1, 0), (1, 1)}


# -- field hardening: a missed deadline is not a lost stage ----------------------------------------


@pytest.mark.parametrize("method", ["info", "prepare"])
async def test_a_missed_deadline_on_a_one_replica_stage_readmits_the_replica_without_rollback(
    tmp_path: Path, make_harness: MakeHarness, method: str
) -> None:
    job = job_of(tmp_path, steps=5)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, c = swarm.add(0, "a"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    await h.coordinator.start()
    await h.step()
    # Step 1: c (stage 1's only replica) misses one deadline in the commit and is dropped.
    c.fail(method, PeerUnavailable("DEADLINE_EXCEEDED: deadline exceeded"))
    for task in await h.lease():
        await h.run(task)
        if method == "info":  # a step whose commit looks at every replica's receipts first
            assert h.coordinator.ledger is not None
            h.coordinator.ledger.suspect = True
    # c still answers at step 1 with the stage's state: it is re-admitted, its gradients of
    # the step discarded and replayed there; nothing rolls back.
    replay = await h.lease()
    print("LOG", swarm.log[-30:], h.coordinator.replicas())
    assert replay == [Task(1, 0, frozenset({1})), Task(1, 1, frozenset({1}))]
    assert h.rollbacks.empty()
    assert not a.called("load_state") and not c.called("load_state")
    assert c.called("discard") == [1]
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a"], ["c"]]
    for task in replay:
        await h.run(task)
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 1
    assert (a.step, c.step) == (2, 2) and h.rollbacks.empty()


async def test_a_one_replica_stage_between_paths_costs_no_other_stage_its_state(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """Stage 1's only replica is behind NAT and its relay dies mid-step (issue 42): for a moment
    nothing answers for it, then it answers again through another relay, still at the step. The
    rollback tried meanwhile must not load step 0 on stage 0 (its replica would lose the trained
    state while stage 1 cannot load anything either, making the rollback certain): it waits, and
    the replica is re-admitted without one."""
    job = job_of(tmp_path, steps=5)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, c = swarm.add(0, "a"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    await h.coordinator.start()
    await h.step()
    gone = PeerUnavailable("UNAVAILABLE: failed to connect to all addresses")
    c.fail("prepare", gone)  # dropped in step 1's commit
    c.fail("info", *[gone] * 4)  # and between paths a while: the first rollback tries fail
    c.fail("load_state", gone)
    for task in await h.lease():
        await h.run(task)
    replay: list[Task] = []
    for _ in range(200):  # the rollback's tries, backing off on the fake clock: c answers again
        replay = (await h.coordinator.lease("t", 8)).tasks
        assert not a.called("load_state"), "stage 0 rolled back while stage 1 could load nothing"
        if replay:
            break
        h.clock.advance(1.0)
        await asyncio.sleep(0.05)
    assert replay == [Task(1, 0, frozenset({1})), Task(1, 1, frozenset({1}))]
    assert h.rollbacks.empty() and not a.called("load_state")
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a"], ["c"]]
    for task in replay:
        await h.run(task)
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 1
    assert (a.step, c.step) == (2, 2) and h.rollbacks.empty()


async def test_a_release_while_apply_is_in_flight_does_not_drop_replicas_that_applied(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path, steps=5)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, c = swarm.add(0, "a"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    await h.coordinator.start()
    applying = c.hold("apply")
    for task in await h.lease():
        await h.run(task)
    await asyncio.wait_for(applying.entered.wait(), 10)
    await until(lambda: a.step == 1)  # a has applied step 0; c's APPLY is still in flight
    await h.coordinator.release("t", [0])  # a trainer gives a (late) microbatch back
    assert "a" in h.coordinator.membership.synced  # at step 1 because it applied: not lost
    applying.open()
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 0
    assert {t.step for t in await h.lease()} == {1}
    assert h.rollbacks.empty() and not a.called("load_state")
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a"], ["c"]]


# -- field hardening: nothing stops the world ----------------------------------------------------
async def test_a_join_and_a_checkpoint_in_flight_hold_up_no_step(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """A joiner's copy (a large stage over a slow link) and a checkpoint's download take as
    long as they take: the next steps train meanwhile, and the joiner becomes a member once it is
    a copy at the open step."""
    job = job_of(tmp_path, steps=6, checkpoint_every=1)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, c = swarm.add(0, "a"), swarm.add(1, "c")
    h = make_harness(job, swarm, checkpoint_dir=tmp_path / "checkpoints")
    await h.coordinator.start()
    n = swarm.add(0, "n")
    copying = n.hold("join")  # its copy is under way until the test lets it go
    saving = c.hold("download_state")  # and so is the checkpoint's download of stage 1
    for task in await h.lease():
        await h.run(task)
    assert (await asyncio.wait_for(h.steps.get(), 5)).step == 0
    await asyncio.wait_for(copying.entered.wait(), 5)
    await asyncio.wait_for(saving.entered.wait(), 5)
    tasks = await h.lease()  # step 1 is open and leased while both are held
    assert tasks and {t.step for t in tasks} == {1}
    for task in tasks:
        await h.run(task)
    assert (await asyncio.wait_for(h.steps.get(), 5)).step == 1
    assert [r.peer for r in h.coordinator.replicas()[0]] == ["a"]  # not a member while copying
    copying.open(), saving.open()
    await until(lambda: [r.peer for r in h.coordinator.replicas()[0]] == ["a", "n"])
    assert n.step == a.step == 2 and h.coordinator.error is None
    await h.step(at={0: "n"})  # a member like any other: its gradients count
    assert n.called("prepare")[-1].microbatches == [0, 1] and n.step == 3


# -- field hardening: restarts -----------------------------------------------------------------


async def test_every_replica_restarted_fresh_resumes_from_the_last_sealed_checkpoint(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path, steps=6, checkpoint_every=2)
    checkpoints = tmp_path / "checkpoints"
    first = FakeSwarm(fingerprint(job), 2)
    first.add(0, "a"), first.add(1, "c")
    h = make_harness(job, first, checkpoint_dir=checkpoints)
    await h.coordinator.start()
    for _ in range(3):
        await h.step()
    await h.coordinator.close()  # the scheduler stops; every replica restarts empty
    swarm = FakeSwarm(fingerprint(job), 2)
    a, c = swarm.add(0, "a"), swarm.add(1, "c")
    again = make_harness(job, swarm, checkpoint_dir=checkpoints)
    assert await again.coordinator.start() == 2  # not step 0: the checkpoint of step 2
    assert a.called("load_state") == [2] and c.called("load_state") == [2]
    assert a.state["w"].item() == 2.0 and c.state["w"].item() == 2.0
    assert await asyncio.wait_for(again.rollbacks.get(), 10) == 2  # the store rewinds to it
    tasks = await again.lease()
    assert {t.step for t in tasks} == {2}  # data position included
    for task in tasks:
        await again.run(task)
    assert (await asyncio.wait_for(again.steps.get(), 10)).step == 2


async def test_startup_reconcile_leaves_out_an_unreachable_replica_and_it_rejoins_later(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path, steps=6)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a", step=3), swarm.add(1, "c", step=3)
    b = swarm.add(0, "b", step=3)
    b.fail("info", PeerUnavailable("DEADLINE_EXCEEDED: deadline exceeded"))
    b.fail("join", PeerUnavailable("UNAVAILABLE: connection refused"))
    h = make_harness(job, swarm)
    assert await h.coordinator.start() == 3
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a"], ["c"]]
    await until(lambda: len(b.called("join")) == 1)  # its first try, in the background, failed
    h.clock.advance(60)  # past b's join backoff
    await h.step()
    await until(lambda: len(h.coordinator.replicas()[0]) == 2)  # a copy made in the background
    assert b.called("join") == ["fake:a", "fake:a"] and b.step == 4
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a", "b"], ["c"]]


async def test_a_checkpoint_on_a_full_disk_is_skipped_and_training_goes_on(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path, steps=4, checkpoint_every=1)
    with tiny_disk(tmp_path / "disk") as disk:
        swarm = FakeSwarm(fingerprint(job), 2)
        swarm.add(0, "a"), swarm.add(1, "c")
        h = make_harness(job, swarm, checkpoint_dir=disk / "checkpoints")
        await h.coordinator.start()
        await h.step()  # the checkpoint of step 1, with room
        filler = fill(disk)
        assert (await h.step()).step == 1  # step 2's checkpoint fails: logged, skipped
        assert (await h.step()).step == 2  # and training goes on
        assert h.coordinator.error is None
        await h.coordinator.flush()  # the failed write runs in the background: let it end
        assert not [p for p in disk.rglob("*") if ".tmp" in p.name]  # no partial files
        assert not (disk / "checkpoints" / "step-00000002").exists()  # nor a torn checkpoint
        assert checkpoint.latest(disk / "checkpoints") == 1
        filler.unlink()
        assert (await h.step()).step == 3  # room again: step 4's checkpoint is written
        assert checkpoint.latest(disk / "checkpoints") == 4
        await h.coordinator.close()


async def test_only_the_newest_sealed_checkpoints_are_kept(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """Issue 27, item 17: every sealed checkpoint stayed, so a long job filled the disk."""
    job = job_of(tmp_path, steps=6, checkpoint_every=1)
    checkpoints = tmp_path / "checkpoints"
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a"), swarm.add(1, "c")
    h = make_harness(job, swarm, checkpoint_dir=checkpoints)
    await h.coordinator.start()
    for _ in range(6):
        await h.step()  # and its checkpoint sealed
    assert checkpoint.sealed(checkpoints) == [4, 5, 6]  # training.keep_checkpoints = 3
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"step-0000000{s}" for s in (4, 5, 6)]
    fewer = job_of(tmp_path, steps=6, checkpoint_every=1, keep_checkpoints=1)
    swarm = FakeSwarm(fingerprint(fewer), 2)
    swarm.add(0, "a", step=6), swarm.add(1, "c", step=6)
    h = make_harness(fewer, swarm, checkpoint_dir=checkpoints)
    assert fingerprint(fewer) == fingerprint(job)  # how many are kept changes no parameter
    await h.coordinator.start()
    await h.coordinator.recovery.save(6, h.coordinator.replicas())
    assert checkpoint.sealed(checkpoints) == [6]


async def test_trainers_heard_from_share_a_step_and_one_gone_stops_counting(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    # A trainer that asks first (the scheduler's embedded one, in-process) must not take the
    # whole step while another waits; a trainer silent for a lease timeout stops counting.
    job = job_of(tmp_path, target_batch_size=16)  # 4 microbatches a step
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a")
    swarm.add(1, "b")
    h = make_harness(job, swarm)
    await h.coordinator.start()
    assert (await h.coordinator.lease("remote", 0)).tasks == []  # heard from, no free slot
    first = await h.coordinator.lease("embedded", 8)
    assert len(first.tasks) == 2  # half of the 4
    assert len((await h.coordinator.lease("remote", 8)).tasks) == 2
    h.clock.advance(LEASE_S + 1)  # both silent for a lease timeout; the leases expired too
    assert len((await h.coordinator.lease("embedded", 8)).tasks) == 4


# -- global-norm clipping -------------------------------------------------------------------------


@pytest.mark.parametrize(("grad_clip", "scale"), [(0.0, 1.0), (10.0, 1.0), (1.0, 1 / (5 + 1e-6))])
async def test_every_apply_carries_one_coefficient_from_the_whole_models_norm(
    tmp_path: Path, make_harness: MakeHarness, grad_clip: float, scale: float
) -> None:
    job = job_of(tmp_path, grad_clip=grad_clip)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, b, c = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    a.sq_norm = b.sq_norm = 9.0  # a pool averages to the same sums: one norm per stage
    c.sq_norm = 16.0  # the whole model's norm: sqrt(9 + 16) = 5
    h = make_harness(job, swarm)
    await h.coordinator.start()
    await h.step()
    assert a.scales == b.scales == c.scales == [scale]
    assert h.coordinator.two_phase.grad_norm == 5.0


async def test_a_half_applied_clipped_step_is_finished_with_the_coefficient_it_was_applied_with(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path, steps=5, grad_clip=1.0)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, c = swarm.add(0, "a"), swarm.add(1, "c")
    first = make_harness(job, swarm)
    await first.coordinator.start()
    await first.step()
    # Step 1: the coordinator dies after c applied it (clipped) and before a did.
    a.sq_norm, c.sq_norm = 0.0, 4.0
    a.hold("apply")
    for task in await first.lease():
        await first.run(task)
    await until(lambda: c.step == 2)
    await first.coordinator.close()
    assert (a.step, a.prepared is not None, c.applied) == (1, True, (1, 1 / (2 + 1e-6)))
    a.gates.clear()
    again = make_harness(job, swarm)
    assert await again.coordinator.start() == 2
    assert a.step == 2 and a.scales[-1] == c.scales[-1] == 1 / (2 + 1e-6)
    assert not a.called("join")


async def test_a_half_applied_clipped_step_whose_coefficient_is_unknown_is_copied(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path, steps=5, grad_clip=1.0)
    swarm = FakeSwarm(fingerprint(job), 2)
    a = swarm.add(0, "a")
    swarm.add(0, "b", step=1), swarm.add(1, "c", step=1)
    a.step, a.prepared = 0, Prepared(0, [], 8, ["fake:a"], 0, "0/0")  # applied by no one here
    h = make_harness(job, swarm)
    assert await h.coordinator.start() == 1
    assert not a.called("apply")  # with a guessed coefficient it could differ from b's
    await until(lambda: len(h.coordinator.replicas()[0]) == 2)
    assert a.called("join") == ["fake:b"] and a.step == 1


async def test_a_long_poll_never_cancels_the_commit_it_waited_on(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """The scheduler's `on_step` publishes the step (a broker round trip) after the next step
    has opened. A trainer long-polling meanwhile waits on that commit's task too; when its wait
    ends, the commit must not be cancelled with the waiter's other futures: its `on_step` would
    never finish (the scheduler's step announcements and metrics stayed at step 0)."""
    job = job_of(tmp_path, steps=3)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a"), swarm.add(1, "c")
    release, finished = asyncio.Event(), list[int]()

    async def publish(record: StepRecord) -> None:  # as the scheduler's: awaits the broker
        await release.wait()
        finished.append(record.step)

    h = make_harness(job, swarm)
    h.coordinator.on_step = publish
    await h.coordinator.start()
    tasks = await h.lease("A", 2)
    poll = asyncio.create_task(h.coordinator.lease("B", 1, wait_s=5.0))  # nothing left: waits
    await asyncio.sleep(0.01)
    for task in tasks:
        await h.run(task, trainer="A")  # the step commits; its on_step waits on the broker
    assert [t.step for t in (await asyncio.wait_for(poll, 5)).tasks] == [1]  # step 1 opened
    release.set()
    await until(lambda: finished == [0])
