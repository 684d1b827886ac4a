"""A replica's round strategy, and its null object: no round (the sync and delayed rules, where
every step is the pool's commit).

A job whose replicas differ between rounds (`Rule.rounds`) holds one strategy chosen once from
its rule (`stage_server.replica.runtime`): a local round (`stage_server.replica.local_round`), an
eager round or the step-eager round (`stage_server.replica.eager_round`). Each is a `NoRound` that
answers what its rule does: the committer (`stage_server.replica.commit`) and a copy following its
source (`stage_server.replica.following`) talk to it directly. `NoRound` refuses every round's
operation with what the job lacks, as torchft's `LocalSGD` and `DiLoCo` are strategies over one
manager.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Protocol

import torch

from stage_server.replica.snapshot import Snapshots
from stage_server.replica.update_log import UpdateLog
from swarm.errors import FailedPrecondition
from swarm.job.config import JobConfig
from swarm.job.rule import EagerOp
from swarm.rpc.state_streams import Update

__all__ = ["NoRound", "Replica"]


class Replica(Protocol):
    """What a round reads and moves of its replica (`stage_server.replica.runtime.StageRuntime`)."""

    stage: int
    step: int  # steps committed so far
    following: bool  # a copy still applying its source's updates: a member's round ends it
    device: torch.device
    optimizer: torch.optim.Optimizer
    snapshots: Snapshots  # states being sent: detached before the state changes in place
    updates: UpdateLog  # for the replicas copying this one

    @property
    def params(self) -> Sequence[torch.Tensor]:  # the optimizer's
        ...


class NoRound:
    """No round: every step is averaged (the sync and delayed rules)."""

    EMPTY_STEPS = False  # whether a step of no samples is one (a local step: it moves nothing)

    def __init__(self, job: JobConfig, replica: Replica) -> None:
        self.job, self.stage = job, replica.stage
        # Weakly: a released replica (its parameters, its optimizer) goes at once, not when
        # the cyclic collector finds it and its round holding each other.
        self._replica = weakref.ref(replica)
        self.samples = 0  # this replica's samples in the round so far (its weight)
        self.synced = -1  # the boundary whose outer step was applied last

    @property
    def replica(self) -> Replica:
        replica = self._replica()
        assert replica is not None  # a round is called by its replica only
        return replica

    def _no_round(self) -> FailedPrecondition:
        return FailedPrecondition(f'stage {self.stage}: rounds are for pool.mode = "local"')

    def _not_eager(self) -> FailedPrecondition:
        return FailedPrecondition(f'stage {self.stage}: not a job with pool.overlap = "eager"')

    def ended(self, boundary: int) -> bool:
        """Whether the round ending at `boundary` was applied here already (a retry)."""
        return False

    def copy_step(self, step: int) -> int:
        """The step a replica at `step` is a whole copy at (`StageRuntime.copy_step`)."""
        return step

    # -- a step's APPLY -------------------------------------------------------------------------
    def keeps(self, grad_sums: list[torch.Tensor], samples: int) -> bool:
        """Whether the round keeps a step's summed gradient (`samples` of them here) for its
        own end, instead of the optimizer's step now."""
        return False

    def took(self, samples: int) -> None:
        """A step of this replica's `samples` was applied."""

    # -- state ----------------------------------------------------------------------------------
    def export(self, names: list[str]) -> dict[str, torch.Tensor]:
        """What a whole state holds of the round (`names`: the parameters' names)."""
        return {}

    def check(self, names: list[str], state: dict[str, torch.Tensor], step: int) -> None:
        """What `load` would refuse of `state`, refused before anything is loaded."""

    def load(self, names: list[str], state: dict[str, torch.Tensor], step: int) -> None:
        """The round from a whole state of step `step` (after the module and optimizer)."""

    # -- a round's end (pool.mode = "local") ----------------------------------------------------
    def prepare(self, boundary: int) -> list[torch.Tensor]:
        """This replica's part of the round's average, which ends before step `boundary` (and
        it is a member now: its updates come from its own pool, no longer its source's)."""
        raise self._no_round()

    def set_prepared(self, boundary: int, sums: list[torch.Tensor], total_samples: int) -> None:
        """Keep the pool's summed pseudo-gradient until `apply`."""
        raise self._no_round()

    def apply(self, boundary: int) -> bool:
        """The round's outer step; True when it was applied before."""
        raise self._no_round()

    # -- pool.overlap = "eager" (`stage_server.replica.eager_round`) -------------------------------
    def eager_step(self, boundary: int, total_samples: int) -> bool:
        """The outer step of the round ending at `boundary`, without waiting for its average;
        True when it was applied before."""
        raise self._not_eager()

    def eager_part(self, boundary: int) -> list[torch.Tensor]:
        """This replica's share of the round that ended at `boundary`, for the pool to sum."""
        raise self._not_eager()

    def set_average(self, boundary: int, sums: list[torch.Tensor]) -> None:
        """The pool's sum of the shares of the round that ended at `boundary` arrived."""
        raise self._not_eager()

    def last_part(self, boundary: int, total_samples: int) -> list[torch.Tensor]:
        """The job's last round: this replica's fresh share, summed by the pool at once."""
        raise self._not_eager()

    def set_last(self, boundary: int, sums: list[torch.Tensor], total_samples: int) -> None:
        """Keep the pool's whole sum of the last round's fresh shares until `last_step`."""
        raise self._no_round()

    def last_step(self, boundary: int) -> bool:
        """The last round's outer step with the pool's whole sum; True when applied before."""
        raise self._not_eager()

    def mean_part(self, boundary: int) -> list[torch.Tensor]:
        """This replica's round start after the job's last round, for the members' mean."""
        raise self._not_eager()

    def set_mean(self, sums: list[torch.Tensor], members: int) -> None:
        """The trained model: the members' mean (`sums` of their starts over `members`)."""
        raise self._not_eager()

    # -- a copy following its source ------------------------------------------------------------
    def follow(self, u: Update) -> bool:
        """Apply a round's end the followed replica applied before step `u.step` (`u.eager`,
        `u.boundary`: as `swarm.rpc.state_streams.Update` says), as it did. True: followed."""
        if u.eager == EagerOp.AVERAGE:  # what the pool summed, whenever it arrived
            self._follow_average(u.boundary, u.grad_sums)
        elif u.eager == EagerOp.STEP:
            self._follow_step(u.step, u.grad_sums, u.total_samples)
        elif not self.ended(u.step):  # pool.mode = "local": the round's end before step `step`
            self._follow_end(u.step, u.grad_sums, u.total_samples)
        return True

    def _follow_average(self, boundary: int, sums: list[torch.Tensor]) -> None:
        raise self._not_eager()

    def _follow_step(self, step: int, sums: list[torch.Tensor], total_samples: int) -> None:
        if not self.ended(step):
            raise self._not_eager()

    def _follow_end(self, step: int, sums: list[torch.Tensor], total_samples: int) -> None:
        raise self._no_round()

    def _on_device(self, sums: list[torch.Tensor]) -> list[torch.Tensor]:
        return [g.to(self.replica.device) for g in sums]
