"""The step ledger's bookkeeping: leases, receipts, replays, races."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from scheduler.coordinator.ledger import Holding, StepLedger
from swarm.clock import FakeClock
from swarm.errors import InvalidArgument
from swarm.rpc.lease import Replica, Task


def _ledger(m: int = 4, stages: int = 3) -> tuple[StepLedger, FakeClock]:
    clock = FakeClock()
    return StepLedger(step=7, microbatches=m, stages=stages, lease_timeout_s=10, clock=clock), clock


def _all(ledger: StepLedger, trainer: str, index: int, peers: list[str]) -> list[Holding]:
    return ledger.report(trainer, 7, index, dict(enumerate(peers)), loss_sum=2.0, samples=4)


def test_leases_are_exclusive_until_they_expire() -> None:
    ledger, clock = _ledger()
    a = ledger.lease("a", 3)
    assert [t.index for t in a] == [0, 1, 2] and a[0] == Task(7, 0, frozenset({0, 1, 2}))
    assert [t.index for t in ledger.lease("b", 3)] == [3]
    assert ledger.lease("b", 3) == []
    clock.t = 11  # every lease expired: a silent trainer's work goes to another
    assert [t.index for t in ledger.lease("b", 5)] == [0, 1, 2, 3]


def test_complete_after_every_stage_of_every_microbatch() -> None:
    ledger, _ = _ledger(m=2)
    for task in ledger.lease("a", 2):
        assert not ledger.complete
        _all(ledger, "a", task.index, ["p0", "p1", "p2"])
    assert ledger.complete and ledger.samples() == 8 and ledger.loss() == 0.5
    assert ledger.holdings(1) == {"p1": [0, 1]}
    assert ledger.lease("a", 5) == []


def test_lost_replica_needs_replay_at_its_stage_only() -> None:
    ledger, _ = _ledger(m=3)
    ledger.lease("a", 3)
    for index, peers in enumerate([["p0", "p1", "p2"], ["p0", "q1", "p2"], ["p0", "p1", "p2"]]):
        _all(ledger, "a", index, peers)
    assert ledger.lose("p1") == [0, 2]
    assert not ledger.complete and ledger.remaining == 2
    replays = ledger.lease("b", 5)
    assert replays == [Task(7, 0, frozenset({1})), Task(7, 2, frozenset({1}))]
    for task in replays:
        ledger.report("b", 7, task.index, {1: "q1"}, loss_sum=None, samples=4)
    assert ledger.complete and ledger.holdings(1) == {"q1": [0, 1, 2]}
    assert ledger.loss() == 6.0 / 12  # losses kept from the first run, not counted again


def test_a_step_s_tasks_are_routed_around_a_replica_the_norm_bound_refused() -> None:
    """The replicas a step's tasks may be routed to: without one its work was refused at (its
    replays are judged on another), and never none at a stage. Another step's are its own."""
    ledger, _ = _ledger(stages=2)
    members = [[Replica("a", "h:1")], [Replica("b", "h:2"), Replica("c", "h:3")]]
    assert ledger.routes(members) == members
    ledger.route_around(1, "c")
    assert ledger.routed_around(1, "c") and not ledger.routed_around(0, "c")
    assert ledger.routes(members) == [members[0], [Replica("b", "h:2")]]
    ledger.route_around(1, "b")  # every replica of the stage: the stage keeps them all
    ledger.route_around(0, "a")
    assert ledger.routes(members) == members
    assert _ledger(stages=2)[0].routes(members) == members  # another step's ledger


def test_race_between_two_trainers_leaves_the_extra_holder_to_the_receipts() -> None:
    # The slow trainer's lease went to the fast one: its word is not taken (any token holder
    # may report, `StepLedger.speaks_for`), so it voids no one. The step is suspect instead:
    # before its PREPARE the commit looks at every replica's receipts and voids x1, which holds
    # one the ledger does not (tests/scheduler/coordinator/test_coordinator.py's straggler).
    ledger, clock = _ledger(m=1)
    ledger.lease("slow", 1)
    clock.t = 11
    ledger.lease("fast", 1)
    assert _all(ledger, "fast", 0, ["p0", "p1", "p2"]) == []
    assert _all(ledger, "slow", 0, ["p0", "x1", "p2"]) == []
    assert ledger.suspect  # (its lease ran out mid-work already)
    assert ledger.complete and ledger.holdings(1) == {"p1": [0]}


def test_stale_reports_and_release() -> None:
    ledger, _ = _ledger(m=2)
    ledger.lease("a", 2)
    assert ledger.report("a", 6, 0, {0: "p0"}, None, 4) == []  # another step: ignored
    assert ledger.remaining == 2
    ledger.release("a", [1])
    assert [t.index for t in ledger.lease("b", 2)] == [1]


def test_a_report_whose_sample_count_is_not_the_microbatch_size_is_refused() -> None:
    # Every microbatch holds exactly microbatch_size samples (swarm.model.data has no partial
    # ones), and
    # the step's gradient is divided by the samples reported: a wrong count would skew it.
    ledger = StepLedger(step=7, microbatches=2, stages=2, microbatch_size=4)
    ledger.lease("a", 2)
    for samples in (0, 3, 5, -4, 4_000_000):
        with pytest.raises(InvalidArgument, match="microbatch_size = 4"):
            ledger.report("a", 7, 0, {0: "p0", 1: "p1"}, loss_sum=2.0, samples=samples)
    assert ledger.remaining == 2 and ledger.samples() == 0 and ledger.holders() == set()
    ledger.report("a", 7, 0, {0: "p0", 1: "p1"}, loss_sum=2.0, samples=4)
    assert ledger.remaining == 1 and ledger.samples() == 4


def test_what_is_open_and_leasable_follows_every_lease_report_loss_and_expiry() -> None:
    """The ledger keeps its open count, free set and who holds how many leases as it goes; at
    every point they equal what a scan of the step finds, through leases, renewals, releases,
    reports (validation ones too), losses, adoptions and expiries, in a seeded random order."""
    rng = random.Random(3)
    clock = FakeClock()
    ledger = StepLedger(0, 12, 3, lease_timeout_s=5.0, clock=clock, evaluations=range(12, 14))
    peers, trainers = ["a", "b", "c"], ["t1", "t2", "t3"]
    for _ in range(4000):
        index, stage = rng.randrange(14), rng.randrange(3)
        peer, trainer = rng.choice(peers), rng.choice(trainers)
        op = rng.random()
        if op < 0.25:
            exclude = set(rng.sample(range(12), 2))
            want = ledger.leasable(exclude)
            lowest = sorted(set(ledger._free) - exclude)  # after `leasable` expired what ran out
            count = rng.randrange(4)
            got = ledger.lease(trainer, count, exclude=exclude)
            assert [t.index for t in got] == lowest[:count] and len(got) <= want
        elif op < 0.45:
            loss = 1.0 if index >= 12 and rng.random() < 0.5 else None
            ledger.report(trainer, 0, index, {stage: peer}, loss, 4)
        elif op < 0.55:
            ledger.renew(trainer, [index])
        elif op < 0.62:
            ledger.release(trainer, [index] if rng.random() < 0.7 else None)
        elif op < 0.75:
            ledger.lose(peer, stage if rng.random() < 0.5 else None)
        elif op < 0.85:
            ledger.adopt(stage, peer, [index], {index}, 4)
        else:
            clock.advance(rng.choice([0.5, 2.0, 6.0]))
        now = clock.now()
        free = {
            i
            for i, stages in ledger._needed.items()
            if stages and not ((held := ledger._leases.get(i)) and held.expires > now)
        }
        assert ledger.leasable() == len(free)
        recount = sum(1 for stages in ledger._needed.values() if stages)
        assert ledger.remaining == recount and ledger.complete == (recount == 0)
        assert set(ledger._free) == free
        rescan = Counter(  # after `leasable`, which expired what ran out
            held.trainer
            for i, held in ledger._leases.items()
            if held.expires > now and ledger._needed.get(i)
        )
        assert {t: ledger.held_by(t) for t in trainers} == {t: rescan[t] for t in trainers}
        assert ledger.holding() == len(+rescan)


def test_validation_microbatches_are_leased_after_training_and_complete_the_step() -> None:
    clock = FakeClock()
    ledger = StepLedger(7, 2, 3, 10, clock, microbatch_size=4, evaluations=range(2, 4))
    tasks = ledger.lease("a", 3)
    assert tasks == [
        Task(7, 0, frozenset({0, 1, 2})),
        Task(7, 1, frozenset({0, 1, 2})),
        Task(7, 2, frozenset(), evaluate=True),
    ]
    for index in (0, 1):
        _all(ledger, "a", index, ["p0", "p1", "p2"])
    assert not ledger.complete and ledger.remaining == 2
    assert ledger.report("a", 7, 2, {}, loss_sum=None, samples=4) == []  # failed: given back
    assert [t.index for t in ledger.lease("b", 5)] == [2, 3]
    ledger.report("b", 7, 3, {}, loss_sum=6.0, samples=4)
    assert not ledger.complete and ledger.val_loss() != ledger.val_loss()  # NaN: one missing
    ledger.report("b", 7, 2, {}, loss_sum=2.0, samples=4)
    ledger.report("a", 7, 2, {}, loss_sum=9.0, samples=4)  # a late second answer: ignored
    assert ledger.complete and ledger.val_loss() == 8.0 / 8
    # Nothing of theirs is a gradient: the step's samples, loss and holdings are training's.
    assert ledger.samples() == 8 and ledger.loss() == 0.5 and ledger.holdings(0) == {"p0": [0, 1]}
    assert ledger.lose("p1") == [0, 1] and ledger.remaining == 2


def test_a_final_evaluation_is_a_ledger_of_validation_microbatches_only() -> None:
    ledger = StepLedger(9, 0, 3, 10, FakeClock(), evaluations=range(4, 6))
    assert not ledger.complete and ledger.val_loss() != ledger.val_loss()
    assert [t.evaluate for t in ledger.lease("a", 5)] == [True, True]
    for index in (4, 5):
        ledger.report("a", 9, index, {}, loss_sum=1.0, samples=2)
    assert ledger.complete and ledger.val_loss() == 0.5 and ledger.samples() == 0
    with pytest.raises(ValueError, match="overlap"):
        StepLedger(9, 4, 3, 10, FakeClock(), evaluations=range(3, 5))


def test_a_step_without_evaluations_has_no_validation_loss() -> None:
    ledger, _ = _ledger()
    assert ledger.val_loss() is None


def test_the_runs_that_count_are_the_route_record_and_a_replays_loss_is_its_own() -> None:
    """pool.mode = "local": each counted gradient names its run; a lost one is replayed by
    another run (another chain), which then counts there, with its own loss at the last stage."""
    ledger, _ = _ledger(m=2, stages=2)
    ledger.lease("t", 2)
    ledger.report("t", 7, 0, {0: "a0", 1: "a1"}, 2.0, 4, ("a0", "a1"))
    ledger.report("t", 7, 1, {0: "b0", 1: "a1"}, 3.0, 4, ("b0", "a1"), ((0, "b0"),))
    assert ledger.samples_held(1, "a1") == 8 and ledger.samples_held(0, "b0") == 4
    assert ledger.lose("a1", 1) == [0, 1]
    assert [(r.index, r.stages) for r in ledger.runs()] == [(0, (0,)), (1, (0,))]
    ledger.lease("t", 2)
    ledger.report("t", 7, 0, {1: "b1"}, 5.0, 4, ("a0", "b1"))
    ledger.report("t", 7, 1, {1: "b1"}, 7.0, 4, ("b0", "b1"))
    assert ledger.complete and ledger.loss() == (5.0 + 7.0) / 8
    runs = {(r.index, r.stages, r.chain, r.back) for r in ledger.runs()}
    assert runs == {
        (0, (0,), ("a0", "a1"), ()),
        (0, (1,), ("a0", "b1"), ()),
        (1, (0,), ("b0", "a1"), ((0, "b0"),)),
        (1, (1,), ("b0", "b1"), ()),
    }
