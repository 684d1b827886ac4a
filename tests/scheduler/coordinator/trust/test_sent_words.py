"""A member's word about what it sent, held to its owner's about what it received
(`scheduler.coordinator.trust.sent_words`, judged by `sum_checks` and `sum_liars`; issue 55): a
member that lies about its own contribution is convicted by two owners and frames no one; one
disagreement leaves both out; an owner that forges its sum within the norms is convicted by its
own words; and in the contributions' audit, a member's lie about what it sent to another owner
moves nothing (the owner's word pins it). Reports made by hand, as in test_sum_liars.py; the
real processes are tests/system/test_poison_rounds.py's."""

from __future__ import annotations

import random
from typing import Any, cast

import pytest
import torch

from scheduler.coordinator.groups import RoundGroup
from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.trust.contributions import Contributions
from scheduler.coordinator.trust.norm_bound import outliers
from scheduler.coordinator.trust.sent_words import judged
from scheduler.coordinator.trust.sum_checks import Checksums, mismatches, replicas_to_leave_out
from scheduler.coordinator.trust.sum_liars import convicted
from stage_server.averaging.checksum import dots
from swarm.proto import stage_pb2 as pb
from swarm.rpc.lease import GradientDigest, MicrobatchResult, Replica, Task
from tests.support.audited_round import PEERS, Ledger, N, round_of
from tests.support.sum_words import NAN, nan_to_part, word_checks

GROUP = RoundGroup(("a", "b", "c"))
LIE = 1e3


def _reports(checks: dict[int, Checksums]) -> dict[int, list[pb.SumCheck]]:
    return {j: c.reports for j, c in checks.items()}


@pytest.mark.attack("55-report")
def test_a_member_lying_about_what_it_sent_is_convicted_and_fails_no_owner() -> None:
    """Before: its wrong r·x made every contributor's r·S of each part it sent to fail, the
    honest owners were named by all and left out, and the liar stayed."""
    lying = word_checks(said={(2, 0): 1.0 + LIE, (2, 1): 1.0 + LIE})
    assert mismatches(_reports(lying), 3) == []  # every owner's sum is its words' sum
    found = convicted({0: GROUP}, {0: lying})
    assert list(found) == [0] and list(found[0]) == [2], found
    assert "what it sent" in found[0][2] and "2 owners" in found[0][2]


def test_one_disagreement_leaves_both_out_and_convicts_no_one() -> None:
    """One word against another: the member lies about what it sent, or the owner about what
    it received, which nobody else can tell apart. Before: the owner alone was left out."""
    one = word_checks(said={(2, 0): 1.0 + LIE})
    assert convicted({0: GROUP}, {0: one}) == {}
    accusations, lines = judged({0: GROUP}, {0: one})
    assert len(lines) == 1 and "what it sent" in lines[0], lines
    assert replicas_to_leave_out(accusations, {0: 3}, {}) == {0: {0: {2}, 2: {0}}}


def test_an_owner_lying_about_what_two_members_sent_is_convicted() -> None:
    lying = word_checks(received={(0, 1): 1.0 + LIE, (0, 2): 1.0 + LIE})
    found = convicted({0: GROUP}, {0: lying})
    assert list(found[0]) == [0], found


@pytest.mark.attack("55-forge")
def test_an_owner_forging_its_sum_within_the_norms_is_convicted_by_its_own_words() -> None:
    """Its sum's norm is within the ceiling; its r·S is not what it says it summed. Before:
    only left out (every contributor's r·S failed alike, which a member's lie also did)."""
    forged = word_checks(sums={(j, 0): 3.5 for j in range(3)})
    found = convicted({0: GROUP}, {0: forged})
    assert list(found[0]) == [0] and "by its own report" in found[0][0], found
    # honest in its own report of the sum, forged to the others: two of them convict it
    to_others = word_checks(sums={(1, 0): 3.5, (2, 0): 3.5})
    found = convicted({0: GROUP}, {0: to_others})
    assert list(found[0]) == [0] and "2 other contributors" in found[0][0], found
    # one other's word is one word: left out, not convicted
    assert convicted({0: GROUP}, {0: word_checks(sums={(1, 0): 3.5})}) == {}
    assert judged({0: GROUP}, {0: word_checks(sums={(1, 0): 3.5})})[1]


def test_honest_words_convict_and_accuse_no_one() -> None:
    assert convicted({0: GROUP}, {0: word_checks()}) == {}
    assert judged({0: GROUP}, {0: word_checks()}) == ({}, [])


def _refused(checks: dict[int, Checksums]) -> dict[int, str]:
    """The norm bound's refusals of the round (each member took one microbatch)."""
    return outliers(GROUP, checks, {0: 1, 1: 1, 2: 1}, 8.0)[0]


@pytest.mark.attack("nan-hidden")
def test_a_nan_sent_to_one_owner_under_finite_words_is_one_disagreement() -> None:
    """Member 2 sends owner 0 a NaN and says it sent finite values. Before, its word was the
    part's expected sum: every member's NaN r·S named the honest owner (left out alone), then
    the next, and the job failed on the NaN (`NonFiniteStep`). Now the NaN sum is what its
    owner says it summed: no member's r·S names it, and the member's word against the
    owner's is one disagreement: both left out, no one convicted."""
    hidden = nan_to_part(0, (2,))
    assert mismatches(_reports(hidden), 3) == []
    assert convicted({0: GROUP}, {0: hidden}) == {}
    accusations, lines = judged({0: GROUP}, {0: hidden})
    assert len(lines) == 1 and "disagree" in lines[0] and "(nan)" in lines[0], lines
    assert replicas_to_leave_out(accusations, {0: 3}, {}) == {0: {0: {2}, 2: {0}}}
    # its taken-back sum said finite besides: it names the owner that way too, the same two go
    lying = nan_to_part(0, (2,))
    lying[2].reports[0].sum_dot = 3.0
    assert [(b.contributor, b.what) for b in mismatches(_reports(lying), 3)] == [(2, "finite S")]
    accusations, _ = judged({0: GROUP}, {0: lying})
    assert replicas_to_leave_out(accusations, {0: 3}, {}) == {0: {0: {2}, 2: {0}}}
    # hidden from both other owners: two disagreements, convicted
    both = word_checks(
        received={(0, 2): NAN, (1, 2): NAN}, sums={(j, k): NAN for j in range(3) for k in (0, 1)}
    )
    for c in both.values():
        c.reports[0].sum_norm = c.reports[1].sum_norm = NAN
    found = convicted({0: GROUP}, {0: both})
    assert list(found[0]) == [2] and "2 owners'" in found[0][2], found


@pytest.mark.attack("nan-hidden")
@pytest.mark.parametrize("field", ["dot"])
def test_a_nan_its_sender_says_too_is_no_disagreement_and_the_norm_bound_refuses_it(
    field: str,
) -> None:
    """An honest sender's NaN (a faulty device): its own word says so as its owner's does, in
    its r·x (a NaN or an infinity always makes it one). No disagreement, no sum to judge: the
    norm bound refuses it.
    Before, a NaN said in its dot alone (its norm finite) passed the bound, and the round with
    it: the pool's average was NaN and the job failed."""
    says = nan_to_part(0, (2,))
    setattr(says[2].reports[0], field, NAN)
    assert mismatches(_reports(says), 3) == []
    assert judged({0: GROUP}, {0: says}) == ({}, [])
    assert list(_refused(says)) == [2], _refused(says)


def test_an_owner_saying_two_members_sent_it_nans_is_convicted() -> None:
    """A hostile owner framing honest senders with a NaN word, and answering a NaN sum: it
    disagrees with two of them (before, every member's NaN r·S named it: left out, not
    convicted)."""
    framing = nan_to_part(0, (1, 2))
    found = convicted({0: GROUP}, {0: framing})
    assert list(found[0]) == [0] and "2 members'" in found[0][0], found


def test_an_owner_naming_a_nan_and_answering_a_finite_sum_is_left_out_alone() -> None:
    """Its word that member 1 sent a NaN, and a finite sum (garbage) answered: no honest
    owner's sum is finite after summing a NaN, so each member that took it back names it, and
    it goes alone (member 1's disagreement with it is one of them)."""
    garbage = nan_to_part(0, (1,), sums=5.0)
    found = mismatches(_reports(garbage), 3)
    assert {(b.contributor, b.what) for b in found} == {(j, "finite S") for j in range(3)}
    accusations, lines = judged({0: GROUP}, {0: garbage})
    assert any("the sum taken back is finite" in line for line in lines), lines
    assert replicas_to_leave_out(accusations, {0: 3}, {}) == {0: {0: {1, 2}}}


def test_an_owner_with_no_words_and_a_nan_of_its_own_answering_a_finite_sum_is_named() -> None:
    """It says nothing of what it summed, reports a NaN in its own contribution, and answers a
    forged finite sum (r·S 3e6 against Σ r·x 3): before, the part was skipped as a sender's NaN
    and the round passed. A part a NaN went into has no finite honest sum: each contributor that
    took one back names it, and it goes alone."""
    silent = word_checks(sums={(j, 0): 3e6 for j in range(3)})
    del silent[0].reports[0].received_dots[:], silent[0].reports[0].received_magnitudes[:]
    silent[0].reports[0].dot = NAN
    found = mismatches(_reports(silent), 3)
    assert {(b.contributor, b.what) for b in found} == {(j, "finite S") for j in range(3)}
    accusations, _ = judged({0: GROUP}, {0: silent})
    assert replicas_to_leave_out(accusations, {0: 3}, {}) == {0: {0: {1, 2}}}


def test_an_honest_float64_gradient_past_the_squares_range_frames_no_one() -> None:
    """Values past 1.3e154 square to infinity where their dots stay finite: every norm and square
    infinite, every dot finite. No word contradicts another (dots are held to dots): nobody is
    named or convicted, and the commit fails the job with its cause, as for any non-finite step.
    A first version held a sender's norm to its owner's dots and banned all three."""
    inf = float("inf")
    big = word_checks()
    for c in big.values():
        for check in c.reports:
            check.norm, check.sum_norm = inf, inf
            check.received[:] = [inf] * len(check.received)
    assert mismatches(_reports(big), 3) == []
    assert judged({0: GROUP}, {0: big}) == ({}, [])
    assert convicted({0: GROUP}, {0: big}) == {}


@pytest.mark.parametrize("own", ["word", "dot", "magnitude", "square"])
def test_an_owner_contradicting_itself_about_its_own_contribution_is_left_out_alone(
    own: str,
) -> None:
    """Its word of what it summed of its own (a NaN) against its own report of it (finite), or
    the other way round (its report NaN in one field, its word finite), or its own NaN said both
    ways with a finite square of it (which the norm bound reads: it would pass): either way the
    sum it answered would be held to no finite word. Before, a NaN in its own report skipped the
    part and a forged sum (r·S 3e6 against Σ r·x 3) passed every check. Every other member
    names it: left out alone."""
    forged = {(j, 0): 3e6 for j in range(3)}
    if own == "word":
        itself = word_checks(received={(0, 0): NAN}, sums=forged)
    elif own == "square":  # its own NaN said both ways, its square of it finite: the bound's blind
        itself = nan_to_part(0, (), said={(0, 0): NAN})
        itself[0].reports[0].received_dots[0] = NAN
    else:
        itself = word_checks(sums=forged)
        setattr(itself[0].reports[0], own, NAN)
    found = mismatches(_reports(itself), 3)
    accusations, lines = judged({0: GROUP}, {0: itself})
    if own == "magnitude":  # its words hold its sum: a NaN scale of its own changes nothing
        assert {(b.part, b.what) for b in found} == {(0, "r·S")}, found
    else:
        assert {(b.part, b.contributor, b.what) for b in found} == {
            (0, 1, "own x"),
            (0, 2, "own x"),
        }
        assert len(lines) == 2 and "contradict" in lines[0], lines
    assert replicas_to_leave_out(accusations, {0: 3}, {}) == {0: {0: {1, 2}}}


# The contributions' audit, with real values: three replicas of N parameters
# (tests/support/audited_round.py).


def _audited(peer: str) -> Contributions:
    """Contributions of a step that audits `peer` alone."""
    contributions = Contributions(1.0, random.Random(1))
    members = [[Replica(p, p) for p in PEERS]]
    contributions.tasks(cast(StepLedger, Ledger()), [Task(5, 0, frozenset({0}))], members)
    ledger, audits = contributions._drawn[5]
    contributions._drawn[5] = (ledger, tuple(a for a in audits if a.peer == peer))
    return contributions


@pytest.mark.attack("55-frame")
def test_a_member_lying_about_what_it_sent_to_another_owner_frames_no_audited_replica() -> None:
    """b is audited, honest; c says it sent a wrong q·x to a's part. Before: b's q·x was told
    from the members' own words, so c's lie moved it and b was banned. Now a's word about
    what it received from b gives b's share of part a, and c's word moves nothing. (What c
    sent to b's own part no owner but b can pin, and b must not learn q: docs/decisions.md.)"""
    contributions = _audited("b")
    (audit,) = contributions._audits(5, 0)
    g = torch.Generator().manual_seed(4)
    grads = [torch.randn(N, generator=g, dtype=torch.float64) for _ in range(2)]
    for index, grad in enumerate(grads):
        dot, magnitude, squares = dots(audit.seed, 0, grad)
        digest = GradientDigest(0, "b", dot, magnitude, squares**0.5, "x and y", audit.seed)
        contributions.record(MicrobatchResult(5, index, {0: "b"}, None, 4, digests=(digest,)))
    xs = [torch.randn(N, generator=g, dtype=torch.float64) for _ in range(3)]
    xs[1] = grads[1] + grads[0]
    held: dict[str, Any] = {"b": [0, 1]}
    assert contributions.judge(5, 0, PEERS, round_of(contributions, xs), held) == []
    framing = round_of(contributions, xs, {0: 1e-2 * float(xs[2].abs().sum())})
    assert contributions.judge(5, 0, PEERS, framing, held) == []
    # the lie is one word against a's: both are left out of the round, no one is convicted
    accusations, lines = judged({0: GROUP}, {0: framing})
    assert replicas_to_leave_out(accusations, {0: 3}, {}) == {0: {0: {2}, 2: {0}}}, lines
    # ... and bent, b is still caught by a's and c's words about what it sent them
    bent = [xs[0], xs[1] * (1 + torch.arange(N, dtype=torch.float64).cos()), xs[2]]
    found = contributions.judge(5, 0, PEERS, round_of(contributions, bent), held)
    assert [peer for peer, _ in found] == ["b"]


@pytest.mark.attack("64-seats")
def test_two_owners_of_one_host_frame_no_member() -> None:
    """Issue 64, item 4: two ids of one token holder owning two parts each say the honest third
    sent them something else: two owners' words convicted it. Seats of one public host are one
    word; two hosts' still convict."""
    framed = word_checks(received={(0, 2): 1.0 + LIE, (1, 2): 1.0 + LIE})
    sybils = RoundGroup(("5.6.7.8:7000", "5.6.7.8:7001", "1.2.3.4:7000"))
    found = convicted({0: sybils}, {0: framed})[0]
    assert sorted(found) == [0, 1]  # each by its own words, which its own sum contradicts
    two_hosts = RoundGroup(("5.6.7.8:7000", "9.10.11.12:7000", "1.2.3.4:7000"))
    assert sorted(convicted({0: two_hosts}, {0: framed})[0]) == [0, 1, 2]
