"""Which replica owners a round's sum checks convict of lying (issue 55, item 2): banned
(`Bans`), not only left out (`sum_checks.replicas_to_leave_out`).

A failed `r·S` names the owner but does not prove it lied: the expected value Σ_j r·x_j is made
of every contributor's own word, and a member that reports a wrong r·x_j (its own contribution's
checksum, which nobody else sees) moves it, so every contributor's `r·S`, the owner's own
included, fails alike; an owner that answered every member the same wrong sum looks the same.
The coordinator cannot tell the two apart, so a failed `r·S` only ever leaves out (a false
accusation costs a replay, never exactness).

A sum's norm is different: ‖S‖ ≤ Σ_j ‖x_j‖, and for a replica's part the ceiling (`norm_ceiling`)
is made of the owner's own word alone, each sender's squared norm as the owner says it summed it
(`SumCheck.received`). What no member can move, two kinds of evidence convict:
- **its own word**: the owner's own report of the sum it answered has a norm past the ceiling
  its own report of what it summed sets. Nobody else's word is in it;
- **two others' words**: two other contributors or more each took back a sum whose norm is past
  that ceiling. A lying member can report one such norm (its own), never another's, so with at
  most one liar in the pool (the audits' own premise: two auditors that agree are believed) one
  of them is honest, and an honest contributor's sum came from the owner.
Anything less (one accuser, the ceiling made of the members' own norms because the owner did not
report what it summed, a part an aggregator owns, a NaN or infinite norm) convicts no one. What
this cannot convict: a forgery that keeps the sum's norm within the ceiling (docs/decisions.md,
"Sum liars banned").
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from scheduler.coordinator.groups import RoundGroup
from scheduler.coordinator.sum_checks import Checksums, norm_ceiling
from swarm.proto import stage_pb2 as pb

__all__ = ["convicted"]

ACCUSERS = 2  # the fewest others whose sums convict an owner (one of them may lie)


def convicted(
    groups: Mapping[int, RoundGroup], checks: Mapping[int, Mapping[int, Checksums]]
) -> dict[int, dict[int, str]]:
    """The replica owners a round's checksums (`checks`: stage -> contributor -> what it
    answered) convict of answering a wrong sum: stage -> group index -> the evidence, in one
    line."""
    found: dict[int, dict[int, str]] = {}
    for stage, of in checks.items():
        m = len(groups[stage].members) - len(groups[stage].aggregators)
        if m < 2 or sorted(of) != list(range(m)):
            continue  # not every contributor answered: nothing is judged (`mismatches`)
        for owner in range(m):
            evidence = _evidence(owner, {j: c.reports for j, c in of.items()}, m)
            if evidence is not None:
                found.setdefault(stage, {})[owner] = evidence
    return found


def _evidence(owner: int, reports: Mapping[int, list[pb.SumCheck]], m: int) -> str | None:
    """Why replica `owner`'s sums of its own part convict it, or None."""
    of = {j: c for j, checks in reports.items() for c in checks if c.part == owner}
    mine = of.get(owner)
    if len(of) < m or mine is None or len(mine.received) != m:
        return None  # the ceiling would rest on the members' own norms: a liar could lower it
    ceiling = norm_ceiling(owner, of, m)
    if not math.isfinite(ceiling) or not all(math.isfinite(c.norm) for c in of.values()):
        return None  # a NaN or infinite contribution: the commit's to refuse (`NonFiniteStep`)
    # A sum that is NaN or infinite is no evidence either: finite contributions may overflow
    # the part's dtype as they are added, or as a lossy codec encodes the sum.
    past = [j for j, c in sorted(of.items()) if math.isfinite(c.sum_norm) and c.sum_norm > ceiling]
    others = [j for j in past if j != owner]
    if owner in past:
        witness, by = owner, "by its own report"
    elif len(others) >= ACCUSERS:
        witness, by = others[0], f"as {len(others)} other contributors took it back"
    else:
        return None
    return (
        f"the sum it answered for its part has ‖S‖ = {of[witness].sum_norm!r}, {by}, past "
        f"{ceiling!r}, the most the norms it says it summed allow (Σ ‖x‖)"
    )
