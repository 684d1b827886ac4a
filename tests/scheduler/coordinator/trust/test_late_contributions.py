"""An audited contribution whose digests come after its round (issue 69 item 4: on the push plane
a microbatch is reported before its audit ends, `client.audit.late_audits`): the round cannot
judge it then, so its judgement waits with the round's reports and is made when the last digest
comes (a bent contribution found wrong, for the ban's rollback to replay its step away; an
honest one passes), at its bound with what came (a microbatch not digested skips it), and never
on a step drawn anew (a rollback's replay: another seed)."""

from __future__ import annotations

import random
from typing import cast

import torch

from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.trust.contributions import Contributions
from stage_server.averaging.checksum import dots
from swarm.rpc.lease import GradientDigest, MicrobatchResult, Replica, Task
from tests.support.audited_round import PEERS, N
from tests.support.audited_round import Ledger as _Ledger
from tests.support.audited_round import digests as _digests
from tests.support.audited_round import grads as _grads
from tests.support.audited_round import round_of as _round

HELD = {p: [0, 1, 2] for p in PEERS}


def _drawn() -> Contributions:
    contributions = Contributions(1.0, random.Random(1))
    members = [[Replica(p, p) for p in PEERS]]
    contributions.tasks(cast(StepLedger, _Ledger()), [Task(5, 0, frozenset({0}))], members)
    return contributions


def _sums(grads: dict[str, list[torch.Tensor]]) -> list[torch.Tensor]:
    return [(grads[p][2] + grads[p][0]) + grads[p][1] for p in PEERS]


def test_a_bent_contribution_whose_digests_come_late_is_found_when_they_come() -> None:
    contributions = _drawn()
    grads = {p: _grads(i) for i, p in enumerate(PEERS)}
    xs = _sums(grads)
    xs[1] = xs[1] * (1 + torch.arange(N, dtype=torch.float64).cos())  # b bends its own
    for p in ("a", "c"):
        _digests(contributions, p, grads[p])
    _digests(contributions, "b", grads["b"][:2])  # its third microbatch's audit still out
    assert contributions.judge(5, 0, PEERS, _round(contributions, xs), HELD) == []  # waits
    assert contributions.bound(5) == []  # step 5's own commit: within its bound still
    # the last digest comes (the audit's own report, `MicrobatchResult.late`)
    late = _late_digests(contributions, "b", grads["b"])
    assert [(peer, stage, step) for peer, stage, _, step in late] == [("b", 0, 5)]
    assert "never saw" in late[0][2]
    assert contributions.bound(6) == []  # judged once


def test_an_honest_contribution_whose_digests_come_late_passes() -> None:
    contributions = _drawn()
    grads = {p: _grads(i) for i, p in enumerate(PEERS)}
    for p in ("a", "c"):
        _digests(contributions, p, grads[p])
    _digests(contributions, "b", grads["b"][:1])
    assert contributions.judge(5, 0, PEERS, _round(contributions, _sums(grads)), HELD) == []
    assert _late_digests(contributions, "b", grads["b"]) == []
    assert contributions.bound(6) == []


def test_a_judgement_past_its_bound_is_made_with_what_came() -> None:
    """A microbatch whose audit was cut (or never digested) skips the audit, logged, as at the
    round: no evidence either way."""
    contributions, grads = _waiting_on_its_third_microbatches()
    assert contributions.bound(6) == []  # step 6 committed: judged now, not wholly digested
    assert _late_digests(contributions, "b", grads["b"]) == []  # too late: nothing waits


def test_a_step_drawn_anew_drops_the_judgements_waiting_on_its_earlier_run() -> None:
    contributions, _ = _waiting_on_its_third_microbatches()
    members = [[Replica(p, p) for p in PEERS]]  # a rollback replays step 5: drawn anew
    contributions.tasks(cast(StepLedger, _Ledger()), [Task(5, 0, frozenset({0}))], members)
    assert contributions._waiting == {}
    assert contributions.bound(6) == []


def _waiting_on_its_third_microbatches() -> tuple[Contributions, dict[str, list[torch.Tensor]]]:
    """A round whose audited contributions (b's bent) have two of their three microbatches
    digested: its judgements wait."""
    contributions = _drawn()
    grads = {p: _grads(i) for i, p in enumerate(PEERS)}
    xs = _sums(grads)
    xs[1] = 5 * xs[1]
    for p in PEERS:
        _digests(contributions, p, grads[p][:2])
    assert contributions.judge(5, 0, PEERS, _round(contributions, xs), HELD) == []
    assert len(contributions._waiting) == 3
    return contributions, grads


def _late_digests(
    contributions: Contributions, peer: str, grads: list[torch.Tensor]
) -> list[tuple[str, int, str, int]]:
    """`peer`'s digests recorded again, the last as the late report that completes them: what
    the judgement waiting for them found."""
    _digests(contributions, peer, grads[:-1])
    (audit,) = [a for a in contributions._audits(5, 0) if a.peer == peer]
    dot, magnitude, squares = dots(audit.seed, 0, grads[-1])
    digest = GradientDigest(0, peer, dot, magnitude, squares**0.5, "x and y", audit.seed)
    late = MicrobatchResult(5, len(grads) - 1, {}, None, 0, digests=(digest,), late=True)
    return contributions.record(late)
