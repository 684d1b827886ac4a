"""Issue 55's poisoners as a real stage server can be made to act (`SWARM_FAULTS`'s hostile
points, `swarm.ops.faults.poisoning`): for the tests and benchmarks that show what the pool's
checks refuse, in processes of their own. Nothing here runs unless such a fault is armed.

- `poison-sum@S`: from step S on (or one step in PERIOD, `@S/PERIOD`), this replica's averager
  answers every part it owns with its sum plus `ERROR` (finite, the same to every member: the
  pool stays identical);
- `poison-forge@S`: likewise, but its sums times 1 - `FORGE`: smaller than the honest sum, so
  within every norm check, what only its checksum (r·S against the words of what was summed)
  can tell;
- `poison-grad@S`: likewise, this replica contributes its gradient sums times `SCALE` (finite,
  every part of it: each sum is the honest sum of what was sent);
- `poison-bent@S`: likewise, its gradient sums with element i times 1 + cos i: honest forward
  and backward answers, a contribution at most twice its honest norm (within the norm bound,
  and neither a scaling nor a shift), what only re-executing its microbatches can tell;
- `poison-nan@S`: likewise, one element of its gradient sums NaN: what one faulty device, or
  one hostile volunteer, would have every member's average be (the norm bound refuses it
  beside finite contributions);
- `lie-report@S`: likewise, it sends honest values but reports r·x (and q·x, an audit's) of
  what it sent to every other owner's part off by `LIE` of its magnitude: its word about what
  it sent against its owners' about what they received;
- `lie-norm@S`: likewise, it averages and reports honestly but answers PREPARE with a NaN
  squared norm of its pool's average (what it keeps to apply is honest): its word alone
  against its pool's, which in a pool of two is no majority;
- `lie-nan@S`: likewise, one element of what it sends the next owner's part (the member after
  it in the group) NaN, while its reports of that part say finite values (r·x and q·x 0, its
  norm that of its own part): the NaN is seen by that one owner, whose word is then against
  the sender's, and every member's sum of that part is NaN.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from stage_server.averaging.owner import Averager
from stage_server.averaging.summing import Reduced, Summer
from swarm.ops.faults import Point, poisoning
from swarm.proto import stage_pb2 as pb

__all__ = ["ERROR", "FORGE", "LIE", "SCALE", "answered_norm", "misreport", "poison"]

log = logging.getLogger(__name__)

ERROR = 1e4  # what a poisoned sum adds to each element
SCALE = 1e4  # what a poisoned contribution is multiplied by
FORGE = 1e-3  # how much smaller a forged sum is
LIE = 1e-3  # how far off a lying report's r·x is, in units of its Σ|r_i·x_i| (plus 1)


def _lying(honest: Summer, forge: bool) -> Summer:
    def summer(
        values: list[torch.Tensor], owned: list[bool], codec: int, block_size: int
    ) -> Reduced:
        reduced = honest(values, owned, codec, block_size)
        wrong = reduced.tensor * (1 - FORGE) if forge else reduced.tensor + ERROR
        return Reduced(wrong, None, wrong)

    summer.honest = honest  # type: ignore[attr-defined]
    return summer


def poison(
    flat: torch.Tensor, averager: Averager, step: int, parts: Sequence[slice], own: int
) -> None:
    """Act hostile in step `step`'s round as this process's faults say: scale `flat` (this
    replica's contribution, in the round's `parts`, its own the `own`th) in place, and make
    `averager` lie in this round (or stop lying, at a step its period skips)."""
    if poisoning(Point.POISON_GRAD, step):
        log.warning("fault injected: %s@%d; contributing x%g", Point.POISON_GRAD, step, SCALE)
        flat.mul_(SCALE)
    if poisoning(Point.POISON_BENT, step):
        log.warning("fault injected: %s@%d; contributing bent sums", Point.POISON_BENT, step)
        bend = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device).cos_().add_(1)
        flat.mul_(bend.to(flat.dtype))
    if poisoning(Point.POISON_NAN, step):
        log.warning("fault injected: %s@%d; contributing a NaN", Point.POISON_NAN, step)
        flat[flat.numel() // 2] = float("nan")
    if poisoning(Point.LIE_NAN, step) and len(parts) > 1:
        k = (own + 1) % len(parts)
        log.warning("fault injected: %s@%d; sending a NaN to part %d", Point.LIE_NAN, step, k)
        flat[parts[k].start] = float("nan")
    honest = getattr(averager.summer, "honest", None)
    lying = [p for p in (Point.POISON_SUM, Point.POISON_FORGE) if poisoning(p, step)]
    if lying and honest is None:
        log.warning("fault injected: %s@%d; every sum owned forged", lying[0], step)
        averager.summer = _lying(averager.summer, lying[0] == Point.POISON_FORGE)
    elif honest is not None and not lying:
        averager.summer = honest


def misreport(checks: Sequence[pb.SumCheck], own: int, step: int) -> tuple[pb.SumCheck, ...]:
    """`checks` (this replica's reports of step `step`'s round, `own` its place in the group) as
    a `lie-report` fault has it say them: r·x of each part it sent to another owner moved by
    `LIE` of its magnitude (the values it sent were honest); or a `lie-nan` fault: each report
    of a part it sent a NaN to said finite (r·x and Σ|r·x| 0, its norm its own part's)."""
    reporting, hiding = poisoning(Point.LIE_REPORT, step), poisoning(Point.LIE_NAN, step)
    if not reporting and not hiding:
        return tuple(checks)
    if reporting:
        log.warning("fault injected: %s@%d; reporting what it sent wrong", Point.LIE_REPORT, step)
    own_norm = next((c.norm for c in checks if c.part == own), 0.0)
    out = []
    for check in checks:
        lied = pb.SumCheck()
        lied.CopyFrom(check)
        if check.part != own and reporting:
            lied.dot += LIE * (check.magnitude + 1.0)
        if check.part != own and hiding and not math.isfinite(check.dot + check.norm):
            lied.dot, lied.magnitude, lied.norm = 0.0, 0.0, own_norm  # as if nothing were amiss
        out.append(lied)
    return tuple(out)


def answered_norm(sq_norm: float, step: int) -> float:
    """The squared norm a PREPARE of step `step` answers: `sq_norm`, or NaN under `lie-norm`."""
    if not poisoning(Point.LIE_NORM, step):
        return sq_norm
    log.warning("fault injected: %s@%d; answering a NaN norm", Point.LIE_NORM, step)
    return float("nan")
