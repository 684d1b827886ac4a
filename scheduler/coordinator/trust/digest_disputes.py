"""Two auditors of a contribution that disagree on a microbatch's gradient digest (issue 55, item
2: "an auditor that lies is caught the same way"; docs/decisions.md, "The parameter-gradient
audit"). Each audited microbatch is re-executed by two other replicas of the stage, which answer
q·g, Σ|q_i·g_i| and ‖g‖ of its parameter gradient (`GradientDigest`); equal bit for bit, their
digest is held to the contribution (`contributions`). Where they differ, the trainer reports
both (`GradientDigest.disputed`), and one word stands against another. An auditor could lie in
its digest alone, its answers honest, and block every audit of others it took part in.

- **The third word is the contribution itself.** q·x_j of the audited replica's contribution is
  told by the round's other members without its word (`contributions`). With at most one liar
  per pool (what the audits rest on), a dispute means one of the two auditors lies and the
  audited replica is honest: its q·x_j is the honest digests' sum. So the digests are totalled
  once with each side's values for the disputed microbatches (the agreed ones common): where
  exactly one total is q·x_j, the auditor whose values made the other is convicted. The audited
  replica cannot lie in its own favour here: a dispute needs an auditor that lies, a second
  liar in the pool. Several pairs of auditors (a stage of four or more): the one auditor in
  every dispute is the suspect; none in all of them takes two liars, and judges nothing.
- **Never a conviction within rounding.** Both totals are taken with the smaller ‖g‖ and
  Σ|q_i·g_i| of each disputed pair, so the tolerance (`contributions`' rounding of the
  accumulation and of the dots) is the same for both and a liar cannot widen it by inflating
  its own; to it is added, per disputed microbatch, what two honest devices' kernels may put
  apart: the job's audit tolerance t (`swarm.job.tolerance`) of Σ|q_i·g_i| plus `SIGMAS` times
  ‖g‖ (a difference |δ_i| ≤ t|g_i| moves q·g by at most tΣ|q_i·g_i|, one of t‖g‖ spread over
  the vector by about t‖g‖). Convicted only where one total is within that of q·x_j and the
  two are more than twice it apart: two honest digests a GPU put apart are never that far from
  each other.
- **As sound as q·x_j.** The liar is a member of the round too, and q·x_j rests on the other
  members' word of what they sent: one that lies there to match its digests would have the
  honest auditor convicted instead (as it could have the audited one, before: docs/decisions.md,
  "What it does not cover").
- **Otherwise nothing is judged**, as before, and the log says why: both totals match (the
  digests differ within the rounding, or in ‖g‖ or Σ|q_i·g_i| alone: q·x_j cannot tell those),
  neither does (two liars), or they are too close to tell.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from scheduler.coordinator.trust.sum_checks import SIGMAS
from swarm.ops.totals import reported_sum
from swarm.rpc.lease import ContributionAudit, GradientDigest

__all__ = ["Compare", "DigestDisputes"]

log = logging.getLogger(__name__)

# (q·x_j from the round's reports, the digests' sum, the rounding allowed): `contributions`'
Compare = Callable[[Sequence[GradientDigest]], tuple[float, float, float]]


class DigestDisputes:
    def __init__(self, tolerance: float = 0.0) -> None:
        """`tolerance`: the job's relative gap between two honest devices' answers
        (`swarm.job.tolerance.tolerance_of`; 0 on one kind of CPU, where they agree bitwise)."""
        self.tolerance = tolerance
        # (step, stage, audited peer) -> microbatch index -> auditor -> its digest
        self._held: dict[tuple[int, int, str], dict[int, dict[str, GradientDigest]]] = {}

    def record(self, step: int, index: int, digest: GradientDigest) -> None:
        """Keep one auditor's digest of microbatch `(step, index)` (`digest.disputed`)."""
        key = (step, digest.stage, digest.peer)
        self._held.setdefault(key, {}).setdefault(index, {})[digest.auditors] = digest

    def digested(self, step: int, audit: ContributionAudit, index: int) -> bool:
        """Whether two auditors' digests that differ of microbatch `(step, index)` came, for
        `audit` (its seed)."""
        held = self._held.get((step, audit.stage, audit.peer), {}).get(index, {})
        return sum(d.seed == audit.seed for d in held.values()) >= 2

    def forget(self, gone: Callable[[int], bool]) -> None:
        """Drop the disputes of the steps `gone` says (drawn anew, or long committed)."""
        for key in [key for key in self._held if gone(key[0])]:
            del self._held[key]

    def judge(
        self,
        step: int,
        audit: ContributionAudit,
        mine: Sequence[int],
        agreed: Mapping[int, GradientDigest],
        compare: Compare,
        consistent: Callable[[float], bool],
    ) -> list[tuple[str, str]]:
        """The auditor convicted of a lying digest in `audit`'s contribution at `step`, with the
        evidence, where `mine` (the microbatches it accumulated) are all digested, `agreed`
        bit for bit or disputed; none otherwise (logged). `consistent(tol)`: whether the
        round's other members took back the same sums, without which q·x_j cannot be told."""
        disputed = self._disputed(step, audit, mine, agreed)
        where = f"step {step} stage {audit.stage}: the audit of {audit.peer}'s contribution"
        digested = sum(i in agreed or i in disputed for i in set(mine))
        if not mine or digested < len(set(mine)) or not disputed:
            log.info(
                "%s is skipped: %d of its %d microbatches digested", where, digested, len(mine)
            )
            return []
        suspects = set.intersection(*(set(pair) for pair in disputed.values()))
        if not suspects:
            log.warning("%s is not judged: no auditor is in every dispute (two liars)", where)
            return []

        def total(liar: str, theirs: bool) -> float:
            """The digests' sum, with `liar`'s disputed values (`theirs`) or the others'."""
            return compare(
                [
                    agreed[i] if i in agreed else _pick(disputed[i], liar, theirs)
                    for i in sorted(set(mine))
                ]
            )[1]

        got, _, tol = compare(
            [agreed[i] if i in agreed else _pick(disputed[i], "", True) for i in sorted(set(mine))]
        )
        tol += reported_sum(self._apart(pair) for pair in disputed.values())
        if not consistent(tol):
            return []  # the others disagree on the sums: the round's sum checks say who
        if not math.isfinite(got) or not math.isfinite(tol):
            # the round's word is not finite (a report of infinities, `reported_sum`): no
            # comparison with it convicts anyone, as none acquits
            log.warning("%s is not judged: the round's q·x is not finite (%s)", where, got)
            return []
        for liar in sorted(suspects):
            honest, lied = total(liar, False), total(liar, True)
            if abs(honest - got) > tol or abs(lied - honest) <= 2 * tol:
                continue
            others = sorted({a for pair in disputed.values() for a in pair} - {liar})
            return [
                (
                    liar,
                    f"auditing {audit.peer}'s contribution to step {step}'s averaging, it "
                    f"answered digests of microbatches {sorted(disputed)} that "
                    f"{' and '.join(others)}'s re-executions contradict: with its values the "
                    f"contribution's microbatches add up to q·x = {lied:.17g}, with "
                    f"{' and '.join(others)}'s to {honest:.17g}, and the round tells "
                    f"{got:.17g} (rounding {tol:.3g})",
                )
            ]
        totals = {a: total(a, True) for a in sorted(suspects)}
        log.warning(
            "%s is not judged: its auditors' digests differ on microbatches %s, and no one "
            "side's add up to its q·x told by the round alone (%.17g; totals %s; rounding %.3g)",
            where,
            sorted(disputed),
            got,
            ", ".join(f"with {a}'s {t:.17g}" for a, t in totals.items()),
            tol,
        )
        return []

    def _disputed(
        self,
        step: int,
        audit: ContributionAudit,
        mine: Sequence[int],
        agreed: Mapping[int, GradientDigest],
    ) -> dict[int, dict[str, GradientDigest]]:
        """Each of `mine` not `agreed` that exactly two auditors digested with `audit`'s seed:
        auditor -> its digest (the smaller ‖g‖ and Σ|q_i·g_i| of the two in both)."""
        held = self._held.get((step, audit.stage, audit.peer), {})
        disputed = {}
        for i in set(mine) - set(agreed):
            pair = {a: d for a, d in held.get(i, {}).items() if d.seed == audit.seed}
            if len(pair) != 2:
                continue
            norm = min(d.norm for d in pair.values())
            magnitude = min(d.magnitude for d in pair.values())
            disputed[i] = {a: replace(d, norm=norm, magnitude=magnitude) for a, d in pair.items()}
        return disputed

    def _apart(self, pair: Mapping[str, GradientDigest]) -> float:
        """How far two honest devices' digests of one gradient may be apart."""
        d = next(iter(pair.values()))  # both carry the smaller norms
        return self.tolerance * (d.magnitude + SIGMAS * d.norm)


def _pick(pair: Mapping[str, GradientDigest], liar: str, theirs: bool) -> GradientDigest:
    """`liar`'s digest of the pair (`theirs`), or the other's."""
    for auditor, d in sorted(pair.items()):
        if (auditor == liar) == theirs:
            return d
    return next(iter(pair.values()))
