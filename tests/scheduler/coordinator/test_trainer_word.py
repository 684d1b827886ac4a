"""A trainer speaks for its own leases only. Any token holder may lease and report as a trainer;
before, a report was taken for any microbatch, leased to its caller or not, and a lease was
renewed for as long as its holder named it: a forged report named another replica the holder of
a microbatch already held (that replica was voided), set a validation loss first, and one leased
microbatch renewed forever held its step open for good."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.coordinator.ledger import LEASE_LIFE_TIMEOUTS, Holding, StepLedger
from swarm.clock import FakeClock
from swarm.job.fingerprint import fingerprint
from swarm.rpc.lease import MicrobatchResult, Verdict
from tests.support.coordinator import MakeHarness, job_of, started
from tests.support.replicas import FakeSwarm

pytestmark = [pytest.mark.timeout(60), pytest.mark.attack("trainer-word")]


async def test_a_report_of_a_microbatch_leased_to_another_is_not_taken(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    # Before: the forger's report of microbatch 0 (held at stage 1 by c, as A reported) naming
    # d was read as a duplicate there, and d was voided (a Discard of its whole step).
    job = job_of(tmp_path, target_batch_size=16)  # 4 microbatches: the step stays open
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a"), swarm.add(1, "c"), swarm.add(1, "d")
    h = make_harness(job, swarm)
    c = h.coordinator
    await c.start()
    assert [t.index for t in (await c.lease("A", 2)).tasks] == [0, 1]
    await h.land(0, 0, {0: "a", 1: "c"}, trainer="A")
    await h.land(0, 1, {0: "a", 1: "d"}, trainer="A")
    forged = MicrobatchResult(0, 0, {0: "a", 1: "d"}, 1.0, 4)
    await c.report("F", forged)
    assert not swarm["d"].called("discard")
    assert c.ledger is not None and c.ledger.holdings(1) == {"c": [0], "d": [1]}


def test_a_lease_once_held_gives_no_word_once_it_is_anothers() -> None:
    # F leased microbatch 0 and let its lease run out; A took it, ran it (c holds it at stage 0)
    # and reported. F's report naming d is not read as a duplicate at d (which would void it),
    # nor is a report of F's before A's report taken as the truth: only the lease's holder
    # (or the last one, its lease run out and given to no one since) speaks for it.
    clock = FakeClock()
    ledger = StepLedger(step=0, microbatches=2, stages=1, lease_timeout_s=10, clock=clock)
    assert [t.index for t in ledger.lease("F", 1)] == [0]
    clock.advance(11)
    assert [t.index for t in ledger.lease("A", 1)] == [0]
    assert ledger.report("F", 0, 0, {0: "d"}, None, 4) == []  # while A runs it
    assert ledger.holdings(0) == {}
    assert ledger.report("A", 0, 0, {0: "c"}, None, 4) == []
    assert ledger.report("F", 0, 0, {0: "d"}, None, 4) == []
    assert ledger.holdings(0) == {"c": [0]}
    # the straggler's case, kept: A's lease of 1 ran out and went to no one, A reports it
    assert [t.index for t in ledger.lease("A", 1)] == [1]
    clock.advance(11)
    assert ledger.report("A", 0, 1, {0: "d"}, None, 4) == []
    assert ledger.holdings(0) == {"c": [0], "d": [1]}
    assert ledger.report("A", 0, 1, {0: "e"}, None, 4) == [Holding(0, "e")]  # its own word


def test_a_report_no_lease_speaks_for_has_its_receipts_looked_at() -> None:
    # After a scheduler restart the step's ledger is new: a trainer's report of before is no
    # lease's word, and what it says landed is looked for in the replicas' receipts (adopted
    # there) before the microbatch is leased again, rather than replayed beside it.
    ledger = StepLedger(step=0, microbatches=2, stages=1)
    assert ledger.report("A", 0, 1, {0: "c"}, None, 4) == []
    assert ledger.returned() == [1] and ledger.suspect
    assert ledger.adopt(0, "c", [1], ledger.returned(), 4) == [1]
    assert ledger.holdings(0) == {"c": [1]}


def test_only_a_lessee_sets_a_validation_loss() -> None:
    ledger = StepLedger(step=0, microbatches=1, stages=1, evaluations=range(1, 2))
    assert [t.index for t in ledger.lease("A", 2)] == [0, 1]
    ledger.report("F", 0, 1, {}, 1e9, 1)  # never leased microbatch 1: not taken
    ledger.report("A", 0, 1, {}, 2.0, 1)
    assert ledger.val_loss() == pytest.approx(2.0)


def test_a_lease_renewed_forever_goes_to_another_after_its_life() -> None:
    clock = FakeClock()
    ledger = StepLedger(step=0, microbatches=1, stages=1, lease_timeout_s=10, clock=clock)
    assert [t.index for t in ledger.lease("A", 1)] == [0]
    renewed = 0
    while ledger.renew("A", [0]) == [0]:  # every 8 s, within each timeout
        renewed += 1
        clock.advance(8)
        assert renewed < 1000, "renewed forever"
    life = LEASE_LIFE_TIMEOUTS * 10
    assert life - 8 < clock.now() <= life + 8, clock.now()  # renewed for its life, no more
    assert [t.index for t in ledger.lease("B", 1)] == [0]  # at once: it ran out at its life


async def test_a_late_report_of_a_committed_step_speaks_only_for_its_lease(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    # A report of a step no longer live (an audit's own report, after its step committed) was
    # checked against no lease: any token holder's, with a verdict (and none of its auditors:
    # the contribution's own commitment convicts), banned the peer it named, and rolled the job
    # back. Only the trainer that spoke for the microbatch speaks for it after the commit.
    h = await started(tmp_path, make_harness, "a", "c", steps=4)
    await h.step()  # step 0 committed, its microbatches leased and reported by "t"
    forged = Verdict("c", 1, "its contribution differs from its commitment")
    late = MicrobatchResult(0, 0, {}, None, 0, verdicts=(forged,), late=True)
    await h.coordinator.report("F", late)  # F leased nothing
    assert "c" not in h.coordinator.bans.banned and h.rollbacks.empty()
    await h.coordinator.report("t", late)  # its lessee's own late report is acted on
    assert "c" in h.coordinator.bans.banned


async def test_a_lessees_word_of_a_duplicate_no_receipt_shows_voids_nobody(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """A lessee (any token holder may lease) reported its microbatch again naming other
    replicas: each was read as holding a straggler's duplicate and voided, a Discard of its
    whole step, one report voiding every replica of every stage. A duplicate is voided where
    the replica's own receipts show it."""
    job = job_of(tmp_path, target_batch_size=16)  # 4 microbatches: the step stays open
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c"), swarm.add(1, "d")
    h = make_harness(job, swarm)
    c = h.coordinator
    await c.start()
    assert [t.index for t in (await c.lease("A", 2)).tasks] == [0, 1]
    await h.land(0, 0, {0: "a", 1: "c"}, trainer="A")
    await h.land(0, 1, {0: "a", 1: "d"}, trainer="A")
    await c.report("A", MicrobatchResult(0, 0, {0: "b", 1: "d"}, 1.0, 4))  # its own microbatch
    assert not swarm["b"].called("discard") and not swarm["d"].called("discard")
    assert c.ledger is not None and c.ledger.holdings(1) == {"c": [0], "d": [1]}
    assert c.ledger.holdings(0) == {"a": [0, 1]}
    # a straggler's true duplicate is voided as before
    assert [t.index for t in (await c.lease("B", 1)).tasks] == [2]
    await h.land(0, 2, {0: "a", 1: "c"}, trainer="B")
    await h.land(0, 2, {0: "b"}, trainer="B")  # run again, its report naming b: b holds it
    assert swarm["b"].called("discard")


async def test_a_lessees_word_of_holders_without_the_receipt_leaves_no_one_out(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """A lessee reported its microbatch held by replicas that never ran it: each refused
    PREPARE (receipts missing), was voided (the microbatches it did hold replayed), and, the
    liar leasing the replay and saying the same again, left out of its pool. A refusal whose
    replica's receipts hold nothing the ledger did not give it belies the trainer's word: the
    microbatch is needed there again, and nobody is voided or left out."""
    job = job_of(tmp_path)  # 2 microbatches a step
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    c = h.coordinator
    await c.start()
    assert [t.index for t in (await c.lease("A", 1)).tasks] == [0]
    await h.land(0, 0, {0: "a", 1: "c"}, trainer="A")  # one honest run
    assert [t.index for t in (await c.lease("A", 1)).tasks] == [1]
    await c.report("A", MicrobatchResult(0, 1, {0: "a", 1: "c"}, 1.0, 4))  # never ran it
    record = await h.replayed({0: "a", 1: "c"}, trainer="B")
    assert record.step == 0 and record.samples == 8
    assert not swarm["a"].called("discard") and not swarm["c"].called("discard")
    assert {r.peer for stage in c.membership.replicas() for r in stage} == {"a", "c"}


async def test_only_a_lessee_giving_work_back_names_why_the_job_stalls(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """The failure a trainer gives its microbatches back with is what a stalled job's status
    names as its cause: any token holder's, holding no lease, set it (`released` of leases it
    never held), and the job's status said what it chose."""
    h = await started(tmp_path, make_harness, "a", "c", steps=4)
    c = h.coordinator
    assert [t.index for t in (await c.lease("A", 1)).tasks] == [0]
    await c.release("F", [0], "stage 1: every replica refused: wire the money first")
    assert c.trainers_failure is None
    await c.release("A", [0], "stage 1: every replica timed out")
    assert c.trainers_failure == "stage 1: every replica timed out"
