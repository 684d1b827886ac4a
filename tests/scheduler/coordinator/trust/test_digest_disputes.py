"""Two auditors of a contribution that disagree on a gradient's digest, the coordinator's side
(`scheduler.coordinator.trust.digest_disputes`, through `Contributions.judge`): the round's q·x of
the audited replica is the third word, so an auditor that lies in its digest alone is convicted;
a disagreement within two honest devices' rounding convicts no one, and neither does one that
q·x cannot settle."""

from __future__ import annotations

import logging
import random
from dataclasses import replace
from typing import cast

import pytest
import torch

from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.trust.contributions import Contributions
from scheduler.coordinator.trust.sum_checks import SIGMAS, Checksums
from stage_server.averaging.checksum import dots
from swarm.rpc.lease import GradientDigest, MicrobatchResult, Replica, Task
from tests.support.audited_round import PEERS, Ledger, grads, round_of

HELD = {p: [0, 1, 2] for p in PEERS}


def _audited(tolerance: float = 0.0) -> Contributions:
    """Every replica's contribution audited at step 5 (`tolerance`: two devices' relative gap)."""
    contributions = Contributions(1.0, random.Random(1), tolerance=tolerance)
    members = [[Replica(p, p) for p in PEERS]]
    contributions.tasks(cast(StepLedger, Ledger()), [Task(5, 0, frozenset({0}))], members)
    return contributions


def _digest(contributions: Contributions, peer: str, g: torch.Tensor, by: str) -> GradientDigest:
    (audit,) = [a for a in contributions._audits(5, 0) if a.peer == peer]
    dot, magnitude, squares = dots(audit.seed, 0, g)
    return GradientDigest(0, peer, dot, magnitude, squares**0.5, by, audit.seed)


def _report(
    contributions: Contributions,
    gradients: dict[str, list[torch.Tensor]],
    lie: dict[str, float],
    liar: str = "c",
) -> None:
    """Each replica's microbatches digested by the two others: agreed, but where `liar` is one
    of the two, whose digest of microbatch 1 moves q·g by `lie[peer]` (times Σ|q_i·g_i|)."""
    for peer in PEERS:
        a, b = (p for p in PEERS if p != peer)
        for index, g in enumerate(gradients[peer]):
            honest = _digest(contributions, peer, g, f"{a} and {b}")
            shift = lie.get(peer, 0.0) if index == 1 and liar in (a, b) else 0.0
            if not shift:
                digests: tuple[GradientDigest, ...] = (honest,)
            else:  # the trainer reports each one's, disputed
                digests = tuple(
                    replace(
                        honest,
                        auditors=p,
                        disputed=True,
                        dot=honest.dot + (shift * honest.magnitude if p == liar else 0.0),
                    )
                    for p in (a, b)
                )
            contributions.record(MicrobatchResult(5, index, {0: peer}, None, 4, digests=digests))


def _honest_round(
    contributions: Contributions, gradients: dict[str, list[torch.Tensor]]
) -> dict[int, Checksums]:
    # each accumulated its microbatches in its own order: the sums differ in their last bits
    xs = [(gradients[p][2] + gradients[p][0]) + gradients[p][1] for p in PEERS]
    return round_of(contributions, xs)


@pytest.mark.attack("P-digest")
def test_an_auditor_that_lies_in_its_digest_alone_is_convicted() -> None:
    """`c` re-executes honestly and answers honestly, but its digest of one microbatch of each
    contribution it audits is off (1e-2 of Σ|q_i·g_i|): q·x of the contribution, told by the
    round, sides with the other auditor. Before, the two digests vouched for nothing and the
    contribution was not judged: `c` blocked the audit of `a` and `b` at no risk."""
    contributions = _audited()
    gradients = {p: grads(i) for i, p in enumerate(PEERS)}
    _report(contributions, gradients, {"a": 1e-2, "b": -1e-2})
    found = contributions.judge(5, 0, PEERS, _honest_round(contributions, gradients), HELD)
    assert {peer for peer, _ in found} == {"c"} and len(found) == 2  # both audits convict it
    evidence = dict(found)["c"]
    assert "answered digests of microbatches [1]" in evidence and "contradict" in evidence


def test_a_disagreement_within_two_devices_rounding_convicts_no_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On a GPU two honest auditors' digests may differ by their kernels' rounding: within it
    (the job's tolerance t of Σ|q_i·g_i| plus `SIGMAS`·t·‖g‖), nobody is convicted, even where
    only one side's total is within the rounding of q·x; far past it, the liar is."""
    t = 1e-6  # as a job on a GPU might allow
    gradients = {p: grads(i) for i, p in enumerate(PEERS)}
    for times, convicted in ((0.5, []), (1.5, []), (1.9, []), (2.5, ["c"]), (100, ["c"])):
        contributions = _audited(tolerance=t)
        d = _digest(contributions, "a", gradients["a"][1], "")
        margin = t * (d.magnitude + SIGMAS * d.norm)
        # at 1.5 and 1.9 only b's side is within the rounding of q·x, but the two are too close
        _report(contributions, gradients, {"a": times * margin / d.magnitude})
        with caplog.at_level(logging.INFO):
            found = contributions.judge(5, 0, PEERS, _honest_round(contributions, gradients), HELD)
        assert [peer for peer, _ in found] == convicted, times
        assert convicted or "is not judged" in caplog.text


def test_a_dispute_q_x_cannot_settle_judges_no_one(caplog: pytest.LogCaptureFixture) -> None:
    """Two liars in the pool (the audited one bent its contribution, an auditor lied in its
    digest): neither side adds up to q·x, and nobody is judged on it (said in the log). A liar
    that inflates its ‖g‖ and Σ|q_i·g_i| to widen the rounding gains nothing: the smaller are
    taken."""
    contributions = _audited()
    gradients = {p: grads(i) for i, p in enumerate(PEERS)}
    _report(contributions, gradients, {"a": 1e-2})
    xs = [(gradients[p][2] + gradients[p][0]) + gradients[p][1] for p in PEERS]
    xs[0] = xs[0] * (1 + torch.arange(xs[0].numel(), dtype=torch.float64).cos())
    with caplog.at_level(logging.INFO):
        assert contributions.judge(5, 0, PEERS, round_of(contributions, xs), {"a": [0, 1, 2]}) == []
    assert "no one side's add up to its q·x" in caplog.text
    inflated = _audited()
    _report(inflated, gradients, {"a": 1e-2})
    key = (5, 0, "a")
    pair = inflated.disputes._held[key][1]
    pair["c"] = replace(pair["c"], norm=1e12, magnitude=1e12)
    found = inflated.judge(5, 0, PEERS, _honest_round(inflated, gradients), {"a": [0, 1, 2]})
    assert [peer for peer, _ in found] == ["c"]


@pytest.mark.attack("inf-report")
def test_a_dispute_against_a_round_that_is_not_finite_convicts_no_one() -> None:
    """`c` lies in its digest of one of `a`'s microbatches, and `b` reports a NaN r·x of what
    it sent `a`'s own part under `a`'s audit seed: q·x of `a`, told by the round, is NaN, and
    no comparison with it says who lied. Before, every comparison with NaN read as "not
    contradicted", and the first suspect, the honest auditor `b`, was convicted."""
    contributions = _audited()
    gradients = {p: grads(i) for i, p in enumerate(PEERS)}
    _report(contributions, gradients, {"a": 1e-2})
    checks = _honest_round(contributions, gradients)
    (audit,) = [a for a in contributions._audits(5, 0) if a.peer == "a"]
    for c in checks[1].audit_checks(audit.seed):
        if c.part == 0:  # `a`'s own part: what b says it sent there
            c.dot = float("nan")
    found = contributions.judge(5, 0, PEERS, checks, HELD)
    assert [peer for peer, _ in found if peer == "b"] == [], found
