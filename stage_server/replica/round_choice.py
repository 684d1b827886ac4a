"""The replica's round under each training rule (`swarm.job.rule`), chosen once when its runtime
is built: none where every step is averaged, a local round, an eager round or the step-eager
round. A sixth rule is a row here."""

from __future__ import annotations

from stage_server.replica.eager_round import EagerRound, StepEagerRound
from stage_server.replica.local_round import LocalRound
from stage_server.replica.no_round import NoRound
from swarm.job.rule import RuleKind

__all__ = ["ROUNDS"]

# The replica's round under each rule.
ROUNDS: dict[RuleKind, type[NoRound]] = {
    RuleKind.SYNC: NoRound,
    RuleKind.DELAYED: NoRound,
    RuleKind.LOCAL: LocalRound,
    RuleKind.LOCAL_EAGER: EagerRound,
    RuleKind.STEP_EAGER: StepEagerRound,
}
