"""The norm bound (issue 55, item 4; `[trust] clip = "norm_bound"`): a replica's contribution to
a step's averaging compared with its pool's, as a defence in depth behind the sum checks.

The sum checks (`sum_checks`) prove that every part's sum is the sum of what was sent; they say
nothing of what a contributor sent. A hostile replica can send any finite gradient, and the one
contribution no one else ever sees is a replica owner's own to its own part. The evidence here is
what each owner reports it summed (`SumCheck.received`: each sender's squared norm of its part,
measured by the owner as it sums, its own included; `stage_server.averaging.owner`), and for an
aggregator's part the contributor's own report (`SumCheck.norm`, which the aggregator's sum
check pins to what was sent). So a contributor's norm ‖x_j‖ is known from the owners of its
parts, and the owner's own from its own report, which the sum check holds to its sum.

Each norm is taken per microbatch (a replica that took more of the step's microbatches sends a
larger sum) and held to `bound` times the median of the other contributors' (those that took
some; with two, the other's: a hostile one's large norm never excuses itself; one that took
every microbatch of the step, `bound`² times the median of its stage's last round that passed).
One past it is refused: the round fails and its microbatches are replayed by the others
(`round_checks`: it stays in its pool unless refused again at the step). No value
is ever scaled, so a step with the rule on equals `swarm local` of the job, a false alarm included
(it costs a replay, never exactness); and an error large enough to matter (the 1e4 of issue 55's
opening case, under Adam an inflated second moment for thousands of steps) is refused whole.
A replica owning a part that reports nothing it summed there, while the others sent it values, is
refused as well: its own contribution would go unseen. What the bound cannot see is a hostile
gradient no larger than an honest one (a sign flipped, a bias within `bound`): that is the
audit's, by re-execution.

A NaN or infinite contribution beside finite ones is refused too, whatever the bound, where the
sender's own word (its norm of some part) says so as the owners' do: before, one faulty device's
NaN made every member's average NaN and the commit failed the job (`NonFiniteStep`). Every
contribution of a stage NaN is the model's or the data's, and stays the commit's (its members'
norms: `scheduler.coordinator.nonfinite`). An owner's word alone that a sender's is NaN or
infinite refuses no one, and keeps that sender out of the medians (it would make them NaN): a
hostile owner could otherwise leave every other contributor out in one round.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

from scheduler.coordinator.groups import RoundGroup
from scheduler.coordinator.trust.sum_checks import Checksums

__all__ = ["outliers"]


def _squares(m: int, of: Mapping[int, Checksums]) -> tuple[list[float], list[int]]:
    """Each contributor's squared norm over every part, from the owners' reports (an
    aggregator's part: the contributor's own), and the replica owners that reported nothing of
    a part the others sent to."""
    squares, silent = [0.0] * m, []
    for k in range(m):
        sent_to = sum(any(c.part == k for c in of[j].reports) for j in range(m) if j != k)
        if not sent_to:
            continue  # an empty part (a client's), or a round of one
        own = next((c for c in of[k].reports if c.part == k), None)
        if own is None or len(own.received) != m:
            silent.append(k)
            continue
        for j, square in enumerate(own.received):
            # A negative square is no honest owner's: counted as none (its sqrt raised, and
            # one report failed the job as a bug). A NaN stays NaN (`outliers`).
            squares[j] += 0.0 if square < 0 else square
    for j in range(m):
        for c in of[j].reports:
            if c.part >= m:  # an aggregator's part: the contributor's own report
                squares[j] += c.norm * c.norm  # inf past 1.3e154, where ** raised
    return squares, silent


def _says_itself(checks: Checksums) -> bool:
    """Whether a contributor's own reports say what it sent is not finite (its norm, r·x or
    Σ|r·x| of some part, any of them: a liar saying a NaN in its dot alone kept its norm finite
    and passed): an owner's word alone that it sent a NaN would let a hostile owner leave every
    other contributor out in one round."""
    return any(not math.isfinite(c.norm + c.dot + c.magnitude) for c in checks.reports)


def outliers(
    group: RoundGroup,
    of: Mapping[int, Checksums],
    samples: Mapping[int, int],
    bound: float,
    before: float | None = None,
) -> tuple[dict[int, str], float | None]:
    """The contributors of one stage's round (`of`: contributor index -> its checksums, with
    `samples` each: its microbatches of the step) whose contribution per microbatch is past
    `bound` times the median of the others', or that summed a part without saying what:
    index -> why, in one line; and the median of the round's contributions per microbatch
    (None: none took any), for the next rounds of the stage. A contributor with no other to
    compare with (it took every microbatch of the step) is held to `bound`² times `before`,
    that median of the stage's last round that passed, if any."""
    m = len(group.members) - len(group.aggregators)
    if m < 2 or sorted(of) != list(range(m)):
        return {}, None
    squares, silent = _squares(m, of)
    found = {k: "it owned a part and reported nothing of what it summed there" for k in silent}
    per_sample = [math.sqrt(s) / max(samples.get(j, 0), 1) for j, s in enumerate(squares)]
    # Those that took microbatches and whose gradient is finite: zeros (a replica that took
    # none) say nothing of the model.
    finite = [
        j
        for j in range(m)
        if math.isfinite(per_sample[j]) and samples.get(j, 0) > 0 and j not in found
    ]
    for j in range(m):
        if not math.isfinite(per_sample[j]) and finite and j not in found and _says_itself(of[j]):
            # Beside finite ones, one replica's (a faulty device's, or a volunteer's that says
            # so): the members' average would be NaN and the commit would fail the job. Every
            # one NaN is the model's or the data's: the commit's (`coordinator.nonfinite`).
            found[j] = (
                f"its contribution is not finite ({per_sample[j]}) while the others' are: "
                "no honest gradient of the same parameters would be, nor would one of a "
                "replica that took no microbatch"
            )
    # The yardstick: those that took microbatches, not refused, whose norm is finite (one an
    # owner's word alone makes NaN or infinite is the commit's, and no part of any median).
    took = [
        j
        for j in range(m)
        if samples.get(j, 0) > 0 and j not in found and math.isfinite(per_sample[j])
    ]
    for j, norm in enumerate(per_sample):
        others = [per_sample[i] for i in took if i != j]
        median = statistics.median(others) if others else before
        if median is None or not math.isfinite(norm):
            continue  # nothing to compare with; not finite by an owner's word alone: no one's
        # A step apart is a looser yardstick than a peer of the same step (a loss spike moves
        # every gradient at once): held to the bound squared.
        allowed = bound * median if others else bound * bound * median
        if norm > allowed:
            factor = f"{bound:g}" if others else f"{bound * bound:g} ({bound:g}²)"
            whose = "the others'" if others else "its stage's last round that passed"
            # The rule is named by the caller (whom it says named the replica); the why says
            # what a reader must not take for proof: honest data can pass the bound too.
            found.setdefault(
                j,
                f"its contribution, {norm:.3g} per microbatch, is past {factor} times the median "
                f"of {whose} ({median:.3g}): a bound an honest gradient spike can pass too",
            )
    kept = [per_sample[j] for j in took if j not in found]
    return found, statistics.median(kept) if kept else None
