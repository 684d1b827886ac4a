"""Issue 55's poisoners as a real stage server can be made to act (`SWARM_FAULTS`'s hostile
points, `swarm.ops.faults.poisoning`): for the tests and benchmarks that show what the pool's
checks refuse, in processes of their own. Nothing here runs unless such a fault is armed.

- `poison-sum@S`: from step S on (or one step in PERIOD, `@S/PERIOD`), this replica's averager
  answers every part it owns with its sum plus `ERROR` (finite, the same to every member: the
  pool stays identical);
- `poison-grad@S`: likewise, this replica contributes its gradient sums times `SCALE` (finite,
  every part of it: each sum is the honest sum of what was sent);
- `poison-bent@S`: likewise, its gradient sums with element i times 1 + cos i: honest forward
  and backward answers, a contribution at most twice its honest norm (within the norm bound,
  and neither a scaling nor a shift), what only re-executing its microbatches can tell.
"""

from __future__ import annotations

import logging

import torch

from stage_server.averaging.owner import Averager
from stage_server.averaging.summing import Reduced, Summer
from swarm.ops.faults import Point, poisoning

__all__ = ["ERROR", "SCALE", "poison"]

log = logging.getLogger(__name__)

ERROR = 1e4  # what a poisoned sum adds to each element
SCALE = 1e4  # what a poisoned contribution is multiplied by


def _lying(honest: Summer) -> Summer:
    def summer(
        values: list[torch.Tensor], owned: list[bool], codec: int, block_size: int
    ) -> Reduced:
        reduced = honest(values, owned, codec, block_size)
        wrong = reduced.tensor + ERROR
        return Reduced(wrong, None, wrong)

    summer.honest = honest  # type: ignore[attr-defined]
    return summer


def poison(flat: torch.Tensor, averager: Averager, step: int) -> None:
    """Act hostile in step `step`'s round as this process's faults say: scale `flat` (this
    replica's contribution) in place, and make `averager` lie in this round (or stop lying, at
    a step its period skips)."""
    if poisoning(Point.POISON_GRAD, step):
        log.warning("fault injected: %s@%d; contributing x%g", Point.POISON_GRAD, step, SCALE)
        flat.mul_(SCALE)
    if poisoning(Point.POISON_BENT, step):
        log.warning("fault injected: %s@%d; contributing bent sums", Point.POISON_BENT, step)
        bend = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device).cos_().add_(1)
        flat.mul_(bend.to(flat.dtype))
    honest = getattr(averager.summer, "honest", None)
    if poisoning(Point.POISON_SUM, step) and honest is None:
        log.warning("fault injected: %s@%d; every sum owned + %g", Point.POISON_SUM, step, ERROR)
        averager.summer = _lying(averager.summer)
    elif honest is not None and not poisoning(Point.POISON_SUM, step):
        averager.summer = honest
