"""A PREPARE norm against its answerer's own words: whose NaN or infinite norm of its pool's
average is its own, majority or not (`scheduler.coordinator.nonfinite` leaves it out alone).

A pool of two has no majority: one member answering a NaN norm beside the other's finite one
failed the job. But each member of a checked round also reports, for every part of the average
it took back, r·S (`SumCheck.sum_dot`) and ‖S‖ (`sum_norm`). r·S finite for every part says the
average is finite (a NaN or an infinity in S makes r·S NaN or infinite, even where r is 0:
0·inf is NaN); the squares of finite values summed in float64 (`swarm.model.optim.
grad_sq_norm`, as every replica computes its norm) are then never NaN, nor is a finite sum's
‖S‖, and infinite only past float64's range, which its ‖S‖ would show. A NaN or infinite norm
against such reports is its answerer's lie, or its own device's fault.

A NaN in the average itself shows in the member's own r·S of the part it came in, and the
majority rule stands; a member asked for no checks (a pool of one, local steps) is read by that
rule alone. A member asked for them that withheld its reports of a part another member of its
stage reported (every member takes back every part's sum, cut alike) has its NaN read as its
own as well: else it would answer nothing to be read by."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from scheduler.coordinator.trust.sum_checks import Checksums
from swarm.ops.totals import reported_sum

__all__ = ["NO_WORDS", "OwnWords", "contradicted", "own_lies"]


@dataclass(frozen=True)
class OwnWords:
    """A member's checksums of its PREPARE's round (`asked`: their reports filled in with its
    answer; None: none asked), and `parts`, the places of the parts' owners in its group: the
    parts whose sums it took back."""

    asked: Checksums | None
    parts: frozenset[int]


NO_WORDS = OwnWords(None, frozenset())  # no checks asked (a pool of one, local steps)
# Past this, a sum of squares may be the float64 rounding of an honest overflow: not read as a
# contradiction (an honest norm this large is a diverged model's anyway).
_FINITE_ENOUGH = 1e300


def contradicted(sq_norm: float, words: OwnWords) -> bool:
    """Whether a member's NaN or infinite squared norm of its pool's average is against its own
    reports of that average: r·S of every part's sum finite, and its ‖S‖ NaN somewhere (no
    finite sum's is), or the norm NaN, or every ‖S‖ finite and their squares within float64's
    range (an honest overflow allowed for: `_FINITE_ENOUGH`)."""
    parts = words.parts
    checks = words.asked.reports if words.asked is not None else []
    if math.isfinite(sq_norm) or not parts or {c.part for c in checks} != parts:
        return False
    if not all(math.isfinite(c.sum_dot) for c in checks):
        return False  # a NaN in the average itself, by its own word: the majority rule's
    norms = [c.sum_norm for c in checks]
    if math.isnan(sq_norm) or any(math.isnan(n) for n in norms):
        return True
    return all(math.isfinite(n) for n in norms) and (
        reported_sum(n * n for n in norms) < _FINITE_ENOUGH
    )


def own_lies(
    reported: Iterable[tuple[int, str, float]], words: Mapping[tuple[int, str], OwnWords]
) -> set[tuple[int, str]]:
    """Of PREPARE's `(stage, peer, squared norm)` answers, the members whose NaN or infinite
    norm their own `words` contradict (`contradicted`), or that withheld reports of a part
    another member of their stage reported."""
    told: dict[int, dict[str, set[int]]] = {}  # stage -> member asked -> the parts it reported
    for (stage, peer), said in words.items():
        if said.asked is not None:
            told.setdefault(stage, {})[peer] = {c.part for c in said.asked.reports}
    lies = set()
    for stage, peer, sq_norm in reported:
        if math.isfinite(sq_norm) or peer not in told.get(stage, {}):
            continue
        mine = told[stage][peer]
        others = set().union(*(p for q, p in told[stage].items() if q != peer))
        if others - mine or contradicted(sq_norm, words[stage, peer]):
            lies.add((stage, peer))
    return lies
