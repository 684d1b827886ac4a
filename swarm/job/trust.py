"""`[trust]`: what a job believes of the peers that serve it (issue 55; docs/jobs.md, "Trust").

Its own module so that everything a job says about hostile peers sits in one table (the defence
in depth here; the audit of stage compute beside it). Nothing in it changes the job's maths (a
refused contribution is replayed by honest replicas, never scaled), so it is not in the
fingerprint: `swarm local` of the job is the same whatever it says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from swarm.job.coerce import GE1, Section, not_allowed
from swarm.job.coerce import checked_field as _f

__all__ = ["TrustConfig"]


@dataclass(frozen=True)
class TrustConfig(Section):
    """`[trust]`: how each step's contributions are held to the pool's. "norm_bound": a
    replica whose contribution to a step's averaging (its gradient sum, per microbatch it
    took) is more than `norm_bound` times the median of its stage's others' is refused: the
    round fails and its microbatches are replayed by the others, so the step stays exact (it
    stays in its pool; refused again at the same step, it is left out). On by default: any
    holder of the swarm's token may serve a job, so its peers are untrusted unless the operator
    knows every one of them (a closed swarm under `--tls-mutual`, say), where "off" saves the
    check."""

    section: ClassVar[str] = "trust"
    #: share of the microbatches each stage re-executes on another replica and compares (either
    #: plane; fraction, 0: off): the audit of stage compute, `client.audit.audits`; with the
    #: audit of contributions it costs about twice this (docs/jobs.md, "Trust": why 0.045)
    audit_fraction: float = _f(0.045, (lambda v: 0 <= v <= 1, "in [0, 1]"))
    clip: Literal["off", "norm_bound"] = "norm_bound"  #: how contributions are compared
    #: the most a replica's contribution per microbatch may be, in medians of the others' (ratio)
    norm_bound: float = _f(8.0, GE1)

    def _validate(self) -> None:
        if not math.isfinite(self.norm_bound):
            raise not_allowed("trust.norm_bound", self.norm_bound, "a finite number >= 1")
