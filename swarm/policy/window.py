"""The trainer's window: how many microbatches it keeps in flight at once.

`[runtime] max_in_flight = N` fixes it at N, as it always did. `"auto"` (the default) sizes it by
what the stages can hold: a replica says, in its load reports, how many microbatches'
activations its cache keeps between their Forward and their Backward (`activation_capacity`,
sized by its device's free memory or by its operator's `--max-activation-cache-bytes`), and the
trainer keeps in flight what the narrowest stage holds over all its replicas. A GPU that holds
forty microbatches then gets forty, not eight; one whose activations fill it gets what fits, so
no Backward recomputes its forward for want of room.

Sizing, in order (`window`):
- only the stages that keep activations narrow it: not the last, whose ForwardBackward is one
  call and keeps nothing (with one stage nothing narrows it);
- a replica's figure counts at most the job's `activation_cache` (no replica keeps more), a
  stage's total is its replicas' sum; a stage none of whose replicas said (a CPU peer at its
  default bound, a peer that predates the figure, or before its first measured microbatch) counts
  `DEFAULT_WINDOW`, today's fixed window, so a swarm that says nothing trains as it did;
- once any stage said: at least one microbatch per stage (a shallower pipeline idles a stage
  whatever the caches hold; a deeper one than a cache holds only recomputes a forward), at most
  `AUTO_CAP` (each microbatch in flight is held by the trainer too: its tokens, and on the carry
  plane its boundary tensors, so announcements must not size the trainer's memory);
- never more than the microbatches live at once: a step's, with its validation microbatches,
  twice under a rule that opens the next step before the last one is applied.

Announced figures are taken only within `MAX_ANNOUNCED_CAPACITY` where they enter the scheduler
(`plausible_capacity`), and bounded again here: a hostile replica (or many) moves a trainer's
window within [stages, AUTO_CAP] and the live microbatches, never its maths (windows never
change results: every microbatch's data and gradient are its own). Pure: every role may call it.
"""

from __future__ import annotations

from collections.abc import Sequence

from swarm.job.rule import rule_of
from swarm.job.schema import JobConfig

__all__ = [
    "AUTO_CAP",
    "DEFAULT_WINDOW",
    "MAX_ANNOUNCED_CAPACITY",
    "live_microbatches",
    "plausible_capacity",
    "window",
]

DEFAULT_WINDOW = 8  #: a stage that says nothing counts this many (the fixed window of old)
AUTO_CAP = 64  #: the most microbatches an automatic window keeps in flight (more: set it by hand)
# The most microbatches a replica's announcement is believed to hold (`plausible_capacity`):
# above any peer's `--max-activation-cache`; past it a figure says nothing.
MAX_ANNOUNCED_CAPACITY = 1 << 16


def plausible_capacity(value: int) -> int:
    """An announced activation capacity (microbatches) as the scheduler keeps it: 0 (not said)
    unless within 1..`MAX_ANNOUNCED_CAPACITY`."""
    return value if 0 < value <= MAX_ANNOUNCED_CAPACITY else 0


def live_microbatches(job: JobConfig) -> int:
    """The most microbatches a trainer could hold leases on at once: a step's training and
    validation microbatches, twice where the next step opens before the last is applied."""
    t = job.training
    step = t.microbatches_per_step + (t.eval_microbatches if t.eval_every > 0 else 0)
    return step * (2 if rule_of(job).delays else 1)


def window(job: JobConfig, capacities: Sequence[Sequence[int]]) -> int:
    """The microbatches a trainer of `job` keeps in flight, given what each replica of each
    stage said it holds (`capacities[stage][replica]`, 0: not said)."""
    fixed = job.runtime.max_in_flight
    if fixed != "auto":
        return fixed
    stages, per_replica = job.training.stages, job.runtime.activation_cache
    keeping = list(capacities)[: stages - 1]  # the last stage keeps nothing between calls
    totals = [sum(min(max(c, 0), per_replica) for c in stage) for stage in keeping]
    said = [t for t in totals if t > 0]
    if len(keeping) < stages - 1 or not said:  # no view of the stages yet, or none said
        sized = DEFAULT_WINDOW
    else:
        narrowest = min(t if t > 0 else DEFAULT_WINDOW for t in totals)
        sized = min(max(narrowest, stages), AUTO_CAP)
    return max(1, min(sized, live_microbatches(job)))
