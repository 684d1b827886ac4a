"""The training rule of a job: how its pools train and average, read once off its job file.

Five rules, from three keys (`pool.mode`, `pool.overlap`, `training.delayed_update`, in that
order below):

- sync (step, none, false): a step computes on every update before it; replicas identical;
- delayed (step, none, true): a step computes on the parameters one update old;
- step-eager (step, eager, true): rounds of one step, the job's optimizer as the outer one; the
  replicas differ by their shares;
- local (local, none, false): each replica its own update; a round averages every `sync_every`;
- local-eager (local, eager, false): as local; a round's averaging runs while the next trains.

Every role asks a `Rule` (`rule_of(job)`), never the keys: only `swarm.job` reads them (the
layering test enforces it). A role that behaves differently under a rule holds one strategy
chosen once from `Rule.kind` or from these answers, with a null object for the plain rule, as
torchft's `LocalSGD` and `DiLoCo` are two strategies over one manager.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, StrEnum
from functools import cache

from swarm.job.schema import JobConfig
from swarm.proto import stage_pb2 as pb

__all__ = ["EagerOp", "Rule", "RuleKind", "rule_of"]


class RuleKind(StrEnum):
    SYNC = "sync"
    DELAYED = "delayed"
    STEP_EAGER = "step-eager"
    LOCAL = "local"
    LOCAL_EAGER = "local-eager"


class EagerOp(IntEnum):
    """What a round's end asks of a replica under an eager rule; the wire's `EagerOp` value for
    value (protos/swarm/proto/stage.proto says what each does). The one spelling in code."""

    NONE = pb.EAGER_NONE
    STEP = pb.EAGER_STEP  # APPLY: the member's outer step with its own fresh share at once
    AVERAGE = pb.EAGER_AVERAGE  # PREPARE: the pool's sum of the round's shares, in the background
    LAST = pb.EAGER_LAST  # the job's last round, waited for: PREPARE sums, APPLY completes
    MEAN = pb.EAGER_MEAN  # PREPARE: every member's round start becomes the pool's mean


@dataclass(frozen=True)
class Rule:
    """One job's training rule; every field is derived from the job once (`rule_of`)."""

    kind: RuleKind
    sync_every: int  # pool.sync_every: steps per round under the local rules

    @property
    def rounds(self) -> bool:
        """Whether a stage's replicas differ between rounds: each applies its own part of a
        step, the pools meet at round ends, the route record says who held what, and `swarm
        local` replays it with replicas (`local`, `local-eager`, `step-eager`)."""
        return self.kind in (RuleKind.LOCAL, RuleKind.LOCAL_EAGER, RuleKind.STEP_EAGER)

    @property
    def round_steps(self) -> int:
        """Steps per round where `rounds`: `pool.sync_every`, or one (`step-eager`); 1 (a step
        is its own commit) otherwise."""
        if self.kind in (RuleKind.LOCAL, RuleKind.LOCAL_EAGER):
            return self.sync_every
        return 1

    @property
    def delays(self) -> bool:
        """Whether step t+1 computes on the parameters before step t's update (delayed_update's
        plain rule; its eager rule applies each step at once and delays only others' shares)."""
        return self.kind is RuleKind.DELAYED

    @property
    def eager(self) -> bool:
        """Whether a round's averaging overlaps the next round (`local-eager`, `step-eager`)."""
        return self.kind in (RuleKind.LOCAL_EAGER, RuleKind.STEP_EAGER)

    @property
    def step_eager(self) -> bool:
        """delayed_update's eager rule: rounds of one step whose outer step is the job's
        optimizer on the step's eager gradient (no outer optimizer, no round start)."""
        return self.kind is RuleKind.STEP_EAGER

    @property
    def local(self) -> bool:
        """Local steps (DiLoCo): each replica its own optimizer; an outer optimizer and a round
        start per pool (`local`, `local-eager`)."""
        return self.kind in (RuleKind.LOCAL, RuleKind.LOCAL_EAGER)

    @property
    def records_routes(self) -> bool:
        """Whether a run's route record is what makes it reproducible (`swarm local --routes`)."""
        return self.rounds

    @property
    def state_copies(self) -> tuple[str, ...]:
        """The prefixes a replica's state (a copy, a checkpoint) holds beside `param/` and
        `optim/`: the parameters before the last update (`prev/`), a round's start and outer
        momentum (`round/`, `outer/`), the member's last share and last average (`share/`,
        `average/`)."""
        copies: tuple[str, ...] = ("prev/",) if self.delays else ()
        if self.local:
            copies += ("round/", "outer/")
        if self.eager:
            copies += ("share/", "average/")
        return copies

    @property
    def state_markers(self) -> frozenset[str]:
        """The one-int64 markers a state of this rule holds: the rounds it has synced, and under
        an eager rule those its share and its average are of."""
        if not self.rounds:
            return frozenset()
        if self.eager:
            return frozenset({"round/synced", "round/shared", "round/averaged"})
        return frozenset({"round/synced"})

    def computes_on(self, step: int, steps: int) -> int:
        """How many updates the parameters step `step` computes on have had, of a job of
        `steps` steps: all before it, or under `delays` all but the last (steps 0 and 1 both on
        the initial parameters); the final evaluation is of the trained parameters either way."""
        if not self.delays or step >= steps:
            return step
        return max(step - 1, 0)

    def is_boundary(self, step: int, steps: int) -> bool:
        """Where `rounds`: whether a round ends before step `step` (after `step` updates of a
        job of `steps` steps): every `round_steps` steps, and after the job's last."""
        return step > 0 and (step % self.round_steps == 0 or step == steps)


def _kind(job: JobConfig) -> RuleKind:
    eager = job.pool.overlap == "eager"
    if job.pool.mode == "local":
        return RuleKind.LOCAL_EAGER if eager else RuleKind.LOCAL
    if eager:  # the schema admits it only with delayed_update
        return RuleKind.STEP_EAGER
    return RuleKind.DELAYED if job.training.delayed_update else RuleKind.SYNC


@cache
def _rule(kind: RuleKind, sync_every: int) -> Rule:
    return Rule(kind, sync_every)


def rule_of(job: JobConfig) -> Rule:
    """The rule `job` trains by (one shared object per rule and round length)."""
    return _rule(_kind(job), job.pool.sync_every)
