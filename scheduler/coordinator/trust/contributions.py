"""The audit of a replica's contribution to its pool's averaging (issue 55, item 1;
docs/decisions.md, "The parameter-gradient audit"): what it added into its gradient sums, which
no trainer sees, held to its microbatches re-executed by others of its stage.

- **Drawn per step**, once per step's ledger (a rollback's replay draws anew): each replica of
  a stage of three or more with probability `drawn_share(audit_fraction)` (about half of
  `[trust] audit_fraction`, all at 1: each of its microbatches runs twice more, so the
  contributions' audit costs what the answers' audit does), from the operating system's
  randomness, with a seed q of its own. The trainers learn them with their tasks
  (`Task.audits`); an audited replica never learns its own.
- **Its contribution, without a word from it**: every other member of its round is sent q with
  its PREPARE and reports, for every part k, q·x_ik of what it sent and q·S_k of the sum it took
  back, and of its own part q·x of what each sender sent it (`Checksums.audit_reports`,
  `SumCheck.received_dots`). Of another replica's part k, j's share is owner k's word about
  what it received from j (`sent_words`: no member's word moves it; the owner's own can, moving
  q·x between j's share and its own, which no other word holds: docs/decisions.md, "What it does
  not cover"); of j's own part (and an
  aggregator's), each sum being the sum of the contributions, q·S_k - Σ_{i≠j} q·x_ik, up to the
  owners' rounding. The audited replica knew r (the round's seed) and could have hidden an error
  from it, not from q. The members' words about what they sent j's own part stand alone: no
  one but j sees those values, and j must not learn q (docs/decisions.md, "What it does not
  cover").
- **Its microbatches, re-executed**: for each microbatch it accumulated at the stage, the
  trainer had two other replicas redo it and digest the parameter gradient with q; their two
  digests, equal bit for bit, are reported (`GradientDigest`) and add up to q·x_j up to the
  rounding of its own accumulation.
- **Judged**: a gap past the rounding bans it (`Bans`: the evidence in the log and the job's
  history, the rollback and the replay that make the job `swarm local`'s again). A microbatch
  without a digest (an auditor gone, a replay from the cache) skips the audit: no evidence
  either way. Two auditors that disagreed are judged between by q·x_j (`digest_disputes`).
- **Judged late, where its digests come late**: on the push plane a microbatch is reported
  before its audit ends (issue 69 item 4, `client.audit.late_audits`), so at the round some of
  an audited replica's digests may still be out. Its judgement then waits, the round's reports
  kept with it, and is made when the last digest comes (`record`) or, at the latest, at the end
  of the next step's commit with what came (`bound`: a microbatch not digested by then skips
  the audit, logged, as one never digested does). A contribution judged wrong then is banned as
  at the round: the ban's rollback replays the step it was applied in away. A step drawn anew (a
  rollback's replay) drops the judgements waiting on its earlier run.

Step rounds only, on either plane (a local-steps or eager round is not audited).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial

from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.trust.digest_disputes import DigestDisputes
from scheduler.coordinator.trust.sum_checks import (
    DOT_BLOCK,
    SIGMAS,
    Checksums,
    new_seed,
    owner_words,
)
from swarm.job.config import JobConfig
from swarm.job.rule import rule_of
from swarm.job.tolerance import tolerance_of
from swarm.ops.totals import reported_sum
from swarm.proto import stage_pb2 as pb
from swarm.rpc.lease import ContributionAudit, GradientDigest, MicrobatchResult, Replica, Task

__all__ = ["Contributions", "Late", "drawn_share"]

# (audited peer, stage, the evidence, the step): a contribution a late judgement found wrong
Late = tuple[str, int, str, int]


@dataclass(frozen=True)
class _Waiting:
    """An audited contribution's judgement, waiting for digests still out at its round."""

    step: int
    audit: ContributionAudit
    mine: tuple[int, ...]  # the microbatches it accumulated
    judge: Callable[[], list[tuple[str, str]]]  # with the round's reports, the digests then


log = logging.getLogger(__name__)

_EPS64 = 2.0**-53


def drawn_share(fraction: float) -> float:
    """The probability a replica's contribution is audited at a step, for a job's
    `audit_fraction` f: f / (2 - f). An audited replica's microbatches run twice more (two
    auditors), the others' are drawn for the answers' audit with probability f, so a
    microbatch-stage is re-executed 2c + f(1 - c) = 2f times on average: the two audits spend
    alike, and the whole costs twice `audit_fraction` (docs/jobs.md, "Trust"). At 1, everything,
    as before."""
    return fraction / (2.0 - fraction) if fraction > 0 else 0.0


class Contributions:
    def __init__(
        self, fraction: float, rng: random.Random | None = None, tolerance: float = 0.0
    ) -> None:
        """`fraction`: the probability each replica is audited at a step (`drawn_share`);
        `tolerance`: two honest devices' relative gap (`DigestDisputes`)."""
        self.fraction = fraction
        self.rng = rng or random.SystemRandom()  # unpredictable to every replica
        # step -> (the ledger it was drawn for, its audits)
        self._drawn: dict[int, tuple[StepLedger, tuple[ContributionAudit, ...]]] = {}
        # (step, stage, audited peer) -> microbatch index -> its digest
        self._digests: dict[tuple[int, int, str], dict[int, GradientDigest]] = {}
        self.disputes = DigestDisputes(tolerance)  # two auditors' digests that differ
        # (step, stage, audited peer) -> its judgement waiting for digests still out
        self._waiting: dict[tuple[int, int, str], _Waiting] = {}
        # the host a peer's seat is on (`Bans` binds `swarm.net.seats`'): two auditors of one
        # host convict no one; unbound, each peer is a host of its own
        self.seat: Callable[[str], str] = str

    @classmethod
    def of(cls, job: JobConfig | None) -> Contributions:
        """A job's: on where rounds are steps' (`[trust] audit_fraction`), on either plane
        (the push plane's trainer redoes a stage from its neighbours' records:
        `client.audit.push_contributions`); off otherwise."""
        if job is None or rule_of(job).rounds:
            return cls(0.0)
        return cls(drawn_share(job.trust.audit_fraction), tolerance=tolerance_of(job))

    def tasks(
        self, ledger: StepLedger, tasks: list[Task], members: Sequence[Sequence[Replica]]
    ) -> list[Task]:
        """`tasks` of `ledger`'s step, with its audits (drawn now if not yet)."""
        audits = self._draw(ledger, members)
        return [t if t.evaluate or not audits else replace(t, audits=audits) for t in tasks]

    def _draw(
        self, ledger: StepLedger, members: Sequence[Sequence[Replica]]
    ) -> tuple[ContributionAudit, ...]:
        drawn = self._drawn.get(ledger.step)
        if drawn is not None and drawn[0] is ledger:
            return drawn[1]
        audits = tuple(
            ContributionAudit(k, r.peer, new_seed())
            for k, stage in enumerate(members)
            for r in stage
            if self.fraction > 0 and len(stage) >= 3 and self.rng.random() < self.fraction
        )
        self._drawn[ledger.step] = (ledger, audits)
        for key in [key for key in self._digests if key[0] == ledger.step]:
            del self._digests[key]
        for step in [s for s in self._drawn if s < ledger.step - 8]:  # long committed
            del self._drawn[step]
            for key in [key for key in self._digests if key[0] == step]:
                del self._digests[key]
        self.disputes.forget(lambda step: step == ledger.step or step < ledger.step - 8)
        for key in [key for key in self._waiting if key[0] >= ledger.step]:  # taken back
            del self._waiting[key]
        return audits

    def _audits(self, step: int, stage: int) -> list[ContributionAudit]:
        drawn = self._drawn.get(step)
        return [a for a in drawn[1] if a.stage == stage] if drawn else []

    def record(self, result: MicrobatchResult) -> list[Late]:
        """Keep `result`'s digests of the contributions its step audits; the contributions a
        judgement that waited for them (wholly digested now) finds wrong."""
        for d in result.digests:
            if not any(
                (a.peer, a.seed) == (d.peer, d.seed) for a in self._audits(result.step, d.stage)
            ):
                continue
            if d.disputed:  # one of two auditors' that differ: judged between at the round
                self.disputes.record(result.step, result.index, d)
            else:
                self._digests.setdefault((result.step, d.stage, d.peer), {})[result.index] = d
        return self._judge_waiting(lambda w: w.step == result.step and self._whole(w.step, w))

    def bound(self, step: int) -> list[Late]:
        """Step `step` committed: the judgements of the steps before it that still wait are
        made with the digests that came (a microbatch not digested skips the audit, logged)."""
        return self._judge_waiting(lambda w: w.step < step)

    def _judge_waiting(self, due: Callable[[_Waiting], bool]) -> list[Late]:
        found = []
        for key, waiting in list(self._waiting.items()):
            if due(waiting):
                del self._waiting[key]
                a = waiting.audit
                found += [(peer, a.stage, why, waiting.step) for peer, why in waiting.judge()]
        return found

    def _whole(self, step: int, waiting: _Waiting) -> bool:
        """Whether every microbatch `waiting`'s audited replica accumulated is digested: by two
        auditors alike, or by two that differ (`disputes`)."""
        a = waiting.audit
        digests = self._digests.get((step, a.stage, a.peer), {})
        return all(i in digests or self.disputes.digested(step, a, i) for i in waiting.mine)

    def seeds_for(self, step: int, stage: int, peer: str) -> tuple[int, ...]:
        """The audits' seeds for `peer`'s PREPARE at `stage`: every other audited one's."""
        return tuple(a.seed for a in self._audits(step, stage) if a.peer != peer)

    def judge(
        self,
        step: int,
        stage: int,
        peers: Sequence[str],
        checks: Mapping[int, Checksums],
        held: Mapping[str, Sequence[int]],
    ) -> list[tuple[str, str]]:
        """The audited contributors of `stage`'s round (`peers`: the contributors by index,
        `checks` their checksums, `held` the microbatches each took) whose contribution is not
        their re-executed microbatches', with the evidence (none where it cannot be told); one
        whose digests are still out is judged when they come (`record`) or at its bound
        (`bound`)."""
        found = []
        for audit in self._audits(step, stage):
            if audit.peer not in peers:
                continue
            j = peers.index(audit.peer)
            by = {i: checks[i].audit_checks(audit.seed) for i in checks if i != j}
            others = list(by.values())
            mine = held.get(audit.peer, [])
            if len(others) != len(peers) - 1 or not all(others):
                continue
            judged = partial(self._judged, step, stage, audit, by, j, mine, len(peers))
            waiting = _Waiting(step, audit, tuple(mine), judged)
            if self._whole(step, waiting):
                found += judged()
            else:  # digests still out (audits that end after their report): judged as they come
                self._waiting[(step, stage, audit.peer)] = waiting
        return found

    def _judged(
        self,
        step: int,
        stage: int,
        audit: ContributionAudit,
        by: Mapping[int, Sequence[pb.SumCheck]],
        j: int,
        mine: Sequence[int],
        members: int,
    ) -> list[tuple[str, str]]:
        """`audit`'s contribution (member `j` of `members`) judged: the round's reports about
        it (`by`: each other member's), held to the digests of its microbatches (`mine`)."""
        others = list(by.values())
        digests = self._digests.get((step, stage, audit.peer), {})
        if not mine or any(index not in digests for index in mine):  # disputed, or missing
            # (two auditors' devices apart: the dispute allows for them, `_apart`)
            compare = partial(_compare, by, j, members=members)
            return self.disputes.judge(
                step, audit, mine, digests, compare, partial(_agreed, others)
            )
        agreed = [digests[i] for i in mine]
        got, expected, tol = _compare(by, j, agreed, members, self.disputes.tolerance)
        if abs(got - expected) <= tol or not _agreed(others, tol):
            return []
        if not math.isfinite(got - expected) or not math.isfinite(tol):
            # A report of infinities (`reported_sum`'s NaN): no evidence either way, as a
            # microbatch never digested is none; a lessee's word of NaN convicts no one.
            log.warning(
                "step %d stage %d: %s's contribution is not judged: the evidence is not finite "
                "(q·x %s, its digests %s)",
                step,
                stage,
                audit.peer,
                got,
                expected,
            )
            return []
        auditors = sorted({digests[i].auditors for i in mine})
        if not any(len({self.seat(a) for a in pair.split(" and ")}) > 1 for pair in auditors):
            log.warning(
                "step %d stage %d: %s's contribution is not judged: its re-executions are all "
                "by seats of one host (%s), whose word alone convicts no one (issue 64)",
                step,
                stage,
                audit.peer,
                ", ".join(auditors),
            )
            return []
        return [
            (
                audit.peer,
                f"its contribution to step {step}'s averaging, q·x = {got:.17g} under a seed "
                f"it never saw, is not its {len(mine)} microbatches' re-executed by "
                f"{', '.join(auditors)} ({expected:.17g}; rounding {tol:.3g})",
            )
        ]


def _agreed(others: Sequence[Sequence[pb.SumCheck]], tol: float) -> bool:
    """Whether the others took back the same sums (their q·S agree): a member that says
    otherwise lies, and with its word the contribution cannot be told (the round's own sum
    checks name an owner that answered members different sums)."""
    sums: dict[int, list[float]] = {}
    for c in (c for o in others for c in o):
        sums.setdefault(c.part, []).append(c.sum_dot)
    return all(max(s) - min(s) <= tol for s in sums.values())


def _compare(
    others: Mapping[int, Sequence[pb.SumCheck]],
    j: int,
    digests: Sequence[GradientDigest],
    members: int,
    tolerance: float = 0.0,
) -> tuple[float, float, float]:
    """(q·x_j, Σ of its microbatches' digests, the rounding allowed). `others`: each other
    member's reports under q, by its place; `tolerance`: the job's relative gap between two
    honest devices' answers (`swarm.job.tolerance.tolerance_of`), held to each microbatch's
    gradient as a digest dispute is (`DigestDisputes`; issue 64: under tf32 or bf16-mixed an
    honest replica on another kind of device was convicted by its own gradients' rounding).
    Of another replica's part, j's share is what its owner says it received from j
    (`sent_words`): no member's word about what it sent moves it. Of a part whose owner said
    no such words (j's own, whose owner must not learn q; an aggregator's), the sum less what
    the others say they sent."""
    sums: dict[int, float] = {}
    sent: dict[int, list[float]] = {}
    reports = [c for o in others.values() for c in o]
    for c in reports:
        sums.setdefault(c.part, c.sum_dot)  # every member took the same sum back
        sent.setdefault(c.part, []).append(c.dot)
    shares = []
    for part, total in sums.items():
        own = next((c for c in others.get(part, ()) if c.part == part), None)
        words = None if own is None else owner_words({part: own}, part, members)
        if words is not None:
            shares.append(words[j][0])
        else:
            shares.append(total - reported_sum(sent[part]))
    got = reported_sum(shares)
    expected = reported_sum(d.dot for d in digests)
    unit = max((c.unit for c in reports), default=0.0)
    n = len(digests)
    norms = reported_sum(c.norm for c in reports) + reported_sum(d.norm for d in digests)
    magnitudes = reported_sum(c.magnitude for c in reports) + reported_sum(
        d.magnitude for d in digests
    )
    # Its own accumulation of n gradients, and the owners' sums of every member's (q unknown
    # to either: `sum_checks`' argument), then the float64 dots of every report and digest.
    summing = SIGMAS * (n + members) * unit * norms
    dotting = 2 * (n + members + 1) * DOT_BLOCK * _EPS64 * magnitudes
    # Its device computed its microbatches' gradients g, the auditors' theirs: apart by some
    # Δg of at most the job's tolerance of ‖g‖, which does not depend on q (secret to both), so
    # |q·Δg| ≤ SIGMAS·‖Δg‖ as the owners' rounding is held (`sum_checks`). Not the worst case,
    # tolerance·Σ|q·g|: that would let a contribution scaled 2x pass.
    devices = SIGMAS * tolerance * reported_sum(d.norm for d in digests)
    return got, expected, summing + dotting + devices
