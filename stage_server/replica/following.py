"""A copy following the replica it copied: it loads that replica's state, then applies the
updates that replica applied since, as it did (same sums, same samples, same optimizer code:
bitwise the same result), until it is a member (its first PREPARE, round's end or Discard ends
the following) or holds work of its own. The download and the asking for updates are
`stage_server.replica.copying`'s; the source's side is its update log
(`stage_server.replica.update_log`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import NamedTuple, Protocol

import torch

from stage_server.replica.no_round import NoRound
from stage_server.replica.step_sums import Sums
from stage_server.replica.tensor_checks import all_finite
from swarm.errors import FailedPrecondition, InvalidArgument
from swarm.rpc.state_streams import Update

__all__ = ["Began", "Following"]


class Began(NamedTuple):
    """Where a replica was as a copy into it began: a copy is stale once either moved."""

    step: int
    loads: int  # states loaded so far (`StageRuntime.loads`)


class Followed(Protocol):
    """What following reads and moves of the replica
    (`stage_server.replica.runtime.StageRuntime`)."""

    stage: int
    step: int
    loads: int
    following: bool
    device: torch.device
    sums: Sums
    round: NoRound

    def load_state(self, step: int, state: dict[str, torch.Tensor]) -> None: ...

    def apply_update(
        self, grad_sums: list[torch.Tensor], total_samples: int, scale: float = 1.0
    ) -> None: ...


class Following:
    """One replica's following of the replica it copied (`following`: whether it still does)."""

    def __init__(self, replica: Followed) -> None:
        self._replica = weakref.ref(replica)  # weakly: as `NoRound` holds its replica

    @property
    def replica(self) -> Followed:
        replica = self._replica()
        assert replica is not None  # called by its replica only
        return replica

    def load(
        self,
        step: int,
        state: dict[str, torch.Tensor],
        began: Began | None = None,
        epoch: int = 0,
    ) -> None:
        """Become a copy of the replica whose state at `step` this is, and follow its updates.
        `began`: this replica's step and `loads` when the copy started. One that moved since (it
        applied a commit as a member meanwhile) or loaded a state (a rollback's, which may leave
        its step as it was) is not overwritten by the copy, which may be older than what it
        holds, or of a trajectory rolled back: FailedPrecondition, and it stays as it is.
        `epoch`: the rollback epoch of the Join that began the copy, its source a member then:
        the state's from now on (`Sums.state_epoch`)."""
        r = self.replica
        if began is not None and began != Began(r.step, r.loads):
            raise FailedPrecondition(
                f"stage {r.stage}: this replica moved from step {began.step} to {r.step} (or "
                f"loaded a state: {r.loads - began.loads}) while copying a state of step {step}: "
                "the copy is stale, not loaded"
            )
        _finite(state.values(), f"stage {r.stage}'s state of step {step}")
        r.load_state(step, state)
        r.sums.copied(epoch)
        r.following = True

    def apply(self, u: Update) -> bool:
        """Apply the update `u` the copied replica applied. False once this replica stopped
        following (it is a member, or holds work of its own): nothing is applied then."""
        r = self.replica
        if not r.following or r.sums.held():
            r.following = False
            return False
        _finite(u.grad_sums, f"stage {r.stage}'s update of step {u.step}")
        # a round's end before step `u.step` (`stage_server.replica.no_round.NoRound`)
        if u.round_end:
            return r.round.follow(u)
        if u.step < r.step:
            return True  # applied already
        if u.step > r.step:
            raise FailedPrecondition(f"stage {r.stage}: update of step {u.step} at {r.step}")
        r.apply_update([g.to(r.device) for g in u.grad_sums], u.total_samples, u.scale)
        return True


def _finite(tensors: Iterable[torch.Tensor], what: str) -> None:
    """On the worker: a source's NaN or infinity is never loaded nor applied (the members' own
    pool sums are refused alike, `stage_server.replica.commit`): served, followed and promoted, it
    failed the job later, naming its learning rate and not the source."""
    if not all_finite(tensors):
        raise InvalidArgument(f"{what} holds NaN or infinity: not taken")
