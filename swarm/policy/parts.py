"""How a round's parts are sized: water-filling over the members' link rates (DeDLOC's linear
program, solved in closed form), and the contiguous element bounds every member derives from the
same weights.

The round (`stage_server.averaging.butterfly`): a vector of V bytes, a group of n members of
which the first m contribute a vector ("contributors") and the rest only own parts
("aggregators"); member i owns the fraction w_i of the vector and sums its part's m
contributions. Each member's link is one full-duplex rate b_i (bytes/s; the coordinator gives
its upload rate), and a member's time is the larger of what it sends and receives over b_i,
the two being equal here:

- a contributor sends its vector less its own part, (1 - w_i)·V, and the sum of its part to the
  m - 1 other contributors, (m - 1)·w_i·V: (1 + (m - 2)·w_i)·V in all, and receives as much (the
  others' contributions to its part, then the other parts' sums);
- an aggregator receives its part from each of the m contributors and sends the sum back to each:
  m·w_i·V.

Minimise T, the slowest member's time, subject to Σ w_i = 1, w_i ≥ 0:
    contributor: (1 + (m - 2)·w_i) / b_i ≤ T   ⇔  w_i ≤ (T·b_i - 1) / (m - 2)   (m > 2)
    aggregator:  m·w_i / b_i ≤ T                ⇔  w_i ≤ T·b_i / m
Each bound grows with T, so the least T is the one at which the capacities sum to 1
(water-filling): w_i = max(0, (T·b_i - 1)/(m - 2)) for a contributor, T·b_i/m for an aggregator.
A contributor also sends its whole vector once whatever it owns: the round lasts at least
max 1/b_i over the contributors (`round_time`), which no partition changes, so the weights are
those of the T above and the bound is the larger of the two. A contributor whose weight is 0
owns nothing (client mode): it only sends its parts and takes their sums back.

Degenerate cases, where the program leaves the partition free or no rate is known, keep today's
equal parts: m = 2 with no aggregator (each contributor's time is 1/b_i whatever it owns), a rate
unknown (0) or all rates equal. m = 2 with aggregators: the contributors' times do not depend on
the partition and an aggregator's only adds to its own, so the two contributors own halves.
m = 1: the lone contributor owns everything (nothing travels). Members the caller names as
`clients` (relayed peers) own nothing whatever their rate: the program runs over the others.

`part_bounds` cuts `numel` elements by the weights with exact rational arithmetic on the doubles
given, so every member derives the same bounds from the same commit on any machine.

A round's parts travel as one value, `Parts` (the weights and how many contributors), from the
coordinator's group (`scheduler.coordinator.groups`) through the commit's wire fields
(`StageCommitRequest.part_weights`, `contributors`) to the butterfly
(`stage_server.averaging.butterfly`), which checks it against its group (`Parts.check`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from fractions import Fraction

from swarm.errors import InvalidArgument

__all__ = [
    "EQUAL_PARTS",
    "MAX_SHARE",
    "Parts",
    "check_weights",
    "contributors_of",
    "part_bounds",
    "round_time",
    "water_fill",
]


@dataclass(frozen=True)
class Parts:
    """A round's parts, which every member of its group cuts alike: `weights`, one per member
    (none: equal parts; 0: that member owns nothing, a client), and how many of the group's
    first members are `contributors` (0: all; the rest are aggregators, which own parts and
    contribute nothing). As it came (from the wire): `check` refuses what a group cannot cut by."""

    weights: Sequence[float] = ()
    contributors: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", tuple(self.weights))  # frozen: not the caller's list

    def check(self, n: int) -> int:
        """The number of contributing members of a group of `n` cut by these parts; refuses
        weights that are not one per member, negative, NaN, infinite or all 0, and contributors
        outside 0..n (`InvalidArgument`)."""
        check_weights(self.weights, n)
        return contributors_of(n, self.contributors)

    def bounds(self, numel: int, n: int) -> list[slice]:
        """The `n` members' contiguous parts of `range(numel)` (`part_bounds`)."""
        return part_bounds(numel, self.weights, n)


# No owner's weight passes MAX_SHARE / (number of owners), whatever the rates say: a member that
# owns most of the vector is the one whose wrong sum spoils most of it, and a rate is what a
# member says of itself (one announcing 1e12 B/s owned a whole pool's vector).
MAX_SHARE = 2.0

EQUAL_PARTS = Parts()
"""Equal parts, every member contributing (a group without aggregators, or alone)."""


def contributors_of(n: int, contributors: int) -> int:
    """The number of contributing members of a group of `n` (`contributors` 0: all of them)."""
    if not 0 <= contributors <= n:
        raise InvalidArgument(f"contributors {contributors} outside 0..{n}")
    return contributors or n


def _equal_among(n: int, owners: Sequence[int]) -> list[float]:
    """`owners` own equal parts (exactly 1/len each), the rest nothing."""
    weights = [0.0] * n
    for i in owners:
        weights[i] = 1.0 / len(owners)
    return weights


def water_fill(
    rates: Sequence[float], contributors: int = 0, *, clients: Collection[int] = ()
) -> list[float]:
    """Each member's fraction of the round's vector (summing to 1, one per member of `rates`,
    the first `contributors` contributing, 0: all), from the members' full-duplex rates
    (bytes/s, 0 unknown): the partition that minimises the slowest member's time (see the
    module). `clients`: members that must own nothing whatever their rate (a relayed peer, whose
    owner traffic would all cross its relay), unless no one else could. Equal parts, exactly 1/n
    each, where the rates cannot tell better (a rate unknown, all equal, two contributors)."""
    n = len(rates)
    if n == 0:
        return []
    m = contributors_of(n, contributors)
    if any(not math.isfinite(b) or b < 0 for b in rates):
        raise InvalidArgument(f"link rates must be finite and >= 0, got {list(rates)}")
    owners = [i for i in range(n) if i not in clients] or list(range(n))
    if m == 1:  # the lone contributor sums alone: nothing travels
        return _equal_among(n, [0])
    if m == 2:  # the contributors' times are 1/b_i whatever they own: aggregators idle
        return _equal_among(n, [i for i in owners if i < m] or owners)
    known = all(rates[i] > 0 for i in owners)
    if not known or (owners[-1] < m and len({rates[i] for i in owners}) == 1):
        return _equal_among(n, owners)
    top = max(rates[i] for i in owners)
    scaled = [b / top for b in rates]  # the weights depend on the ratios only: no overflow
    return _bounded_fill(scaled, m, owners, min(1.0, MAX_SHARE / len(owners)))


def _bounded_fill(
    rates: Sequence[float], m: int, owners: Sequence[int], bound: float
) -> list[float]:
    """Water-filling (m > 2, every owner's rate known) where no owner's weight passes `bound`:
    an owner the level would give more is held at the bound, and the level is found anew for
    what the others share (at most one pass per owner)."""
    n = len(rates)
    held: set[int] = set()
    while True:
        free = [i for i in owners if i not in held]
        budget = 1.0 - bound * len(held)
        level = _level(
            [rates[i] for i in free if i < m], [rates[i] for i in free if i >= m], m, budget
        )
        caps = [0.0] * n
        for i in free:
            b = rates[i]
            caps[i] = max(0.0, (level * b - 1.0) / (m - 2)) if i < m else level * b / m
        total = math.fsum(caps)
        weights = [bound if i in held else c / total * budget for i, c in enumerate(caps)]
        over = {i for i in free if weights[i] > bound}
        if not over or len(held | over) == len(owners):
            return weights  # the level's rounding is not the weights'
        held |= over


def _level(
    contributing: Sequence[float], aggregating: Sequence[float], m: int, budget: float = 1.0
) -> float:
    """The T (seconds per byte of the vector) at which the owners' capacities sum to `budget`,
    m > 2, given the rates of the contributors and aggregators that may own: with the k fastest
    contributors active, Σ (T·b_i - 1)/(m - 2) + T·Σ_agg b_j/m = budget gives
    T = (budget + k/(m - 2)) / (Σ_k b_i/(m - 2) + Σ_agg b_j/m); the right k is the first whose
    T is at most the next contributor's threshold 1/b_(k+1) (the capacities' sum grows with T)."""
    fast = sorted(contributing, reverse=True)
    agg = math.fsum(aggregating) / m
    active = 0.0
    for k in range(len(fast) + 1):
        if k:
            active += fast[k - 1]
        speed = active / (m - 2) + agg
        if speed <= 0:
            continue  # no one owns anything yet (no aggregator, no contributor active)
        level = (budget + k / (m - 2)) / speed
        if k == len(fast) or level <= 1.0 / fast[k]:  # the next contributor would own nothing
            return level
    raise InvalidArgument("no member can own a part")


def round_time(
    rates: Sequence[float], weights: Sequence[float], contributors: int, nbytes: float
) -> float:
    """The time (s) the round of an `nbytes` vector takes by the model of the module under these
    `weights` (empty: equal parts): the slowest member's traffic over its rate, at least the
    slowest contributor's whole vector. Unknown rates (0): inf when that member moves bytes."""
    n = len(rates)
    m = contributors_of(n, contributors)
    weights = list(weights) or [1.0 / n] * n
    if len(weights) != n:
        raise InvalidArgument(f"{len(weights)} weights for {n} members")
    worst = 0.0
    for i, (b, w) in enumerate(zip(rates, weights, strict=True)):
        traffic = (1.0 + (m - 2) * w) if i < m else m * w
        if i < m and m > 1:
            traffic = max(traffic, 1.0)  # its whole vector leaves once, owned part or not
        if m == 1:
            traffic = (1.0 - w) if i == 0 else w  # the lone contributor's parts, there and back
        if traffic > 0:
            worst = max(worst, math.inf if b <= 0 else traffic * nbytes / b)
    return worst


def check_weights(weights: Sequence[float], n: int) -> None:
    """Refuse weights a round cannot cut by: not one per member, negative, NaN or infinite, or
    all zero. Empty: equal parts."""
    if not weights:
        return
    if len(weights) != n:
        raise InvalidArgument(f"{len(weights)} part weights for a group of {n}")
    if any(not math.isfinite(w) or w < 0 for w in weights) or not any(w > 0 for w in weights):
        raise InvalidArgument(f"part weights must be finite, >= 0 and not all 0: {list(weights)}")


def part_bounds(numel: int, weights: Sequence[float], n: int = 0) -> list[slice]:
    """Contiguous parts of `range(numel)`, part k about `weights[k]` of it (a weight 0: an empty
    part). Exact rational arithmetic on the doubles given (the same bounds on every machine).
    Equal weights, or none (then `n` parts), cut as `split_parts` does: the first `numel % n`
    one element longer."""
    if numel < 0:
        raise InvalidArgument(f"cannot split {numel} elements")
    if not weights or len(set(weights)) == 1:
        count = len(weights) or n
        if count < 1:
            raise InvalidArgument("part_bounds needs weights or a number of parts")
        if weights:
            check_weights(weights, count)
        q, r = divmod(numel, count)
        cuts = [k * q + min(k, r) for k in range(count + 1)]
    else:
        check_weights(weights, len(weights))
        exact = [Fraction(w) for w in weights]
        total, so_far, cuts = sum(exact), Fraction(0), [0]
        for w in exact[:-1]:
            so_far += w
            cuts.append(math.floor(numel * so_far / total + Fraction(1, 2)))
        cuts.append(numel)
    return [slice(cuts[k], cuts[k + 1]) for k in range(len(cuts) - 1)]
