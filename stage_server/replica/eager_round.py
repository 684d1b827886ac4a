"""A replica's eager rounds: `pool.overlap = "eager"` over local steps, and delayed_update's eager
rule (rounds of one step).

Nothing waits for the average (`eager_step`): at a round's end the replica takes the outer step
at once with the pool's average of the round before plus its own fresh share minus its own share
of the round before (`eager_gradient`, the reference's rule), and the pool sums the fresh shares
while the next round trains (`set_average`), for the next round's end. Its start, outer
momentum, last share and that average are its own (the members differ by their shares) and
travel with its state too (`share/`, `average/`, and which round each is of). The job's last
round is waited for (`last_part`, `last_step`: the whole average instead of the own share) and
the trained model is the members' mean (`mean_part`, `set_mean`).

delayed_update's eager rule (`StepEagerRound`) is a round of one step whose outer step is the
job's optimizer on the parameters themselves: a step's APPLY only keeps the replica's gradient
sums (`keeps`); its share is those sums over the pool's samples of the step at this stage, and
there is no start or outer optimizer of its own.
"""

from __future__ import annotations

import torch

from stage_server.replica.local_round import AVERAGED, SHARED, LocalRound
from stage_server.replica.no_round import Replica
from swarm.errors import FailedPrecondition, InvalidArgument
from swarm.job.config import JobConfig
from swarm.job.rule import EagerOp
from swarm.model.optim import update
from swarm.model.outer_rules import eager_gradient
from swarm.rpc.state_streams import Update

__all__ = ["EagerRound", "StepEagerRound"]


class EagerRound(LocalRound):
    def __init__(self, job: JobConfig, replica: Replica) -> None:
        super().__init__(job, replica)
        # this replica's share of the round that ended at `shared`, and the pool's sum of the
        # shares of the round that ended at `averaged` (-1, None: none yet)
        self.share: list[torch.Tensor] | None = None
        self.shared = -1
        self.average: list[torch.Tensor] | None = None
        self.averaged = -1
        # the last round's (boundary, the pool's whole sum of fresh shares, its samples)
        self._last: tuple[int, list[torch.Tensor], int] | None = None

    @property
    def pending(self) -> bool:
        """Whether the pool's sum of this replica's last share has not arrived yet."""
        return self.shared > self.averaged

    def copy_step(self, step: int) -> int:
        """A copy at `step - 1` also while the pool's sum of its last share has not arrived."""
        return step - 1 if self.pending else super().copy_step(step)

    def fresh_share(self, total_samples: int) -> list[torch.Tensor]:
        """This replica's share of the round's pseudo-gradient: (start - parameters) x its
        samples / the round's `total_samples` (the reference's expression, bit for bit)."""
        ratio = self.samples / total_samples
        with torch.no_grad():
            return [(s - p.detach()) * ratio for s, p in zip(self.start, self.params, strict=True)]

    def eager_step(self, boundary: int, total_samples: int) -> bool:
        """The outer step of the round ending at `boundary`, at once: the last average plus the
        fresh share minus the last share (none when the pool took no sample: nothing moves then
        but the parameters back to the start); True when it was applied before."""
        if self.ended(boundary):
            return True
        self._at(boundary)
        self.replica.following = False  # a member now: its updates come from its own pool
        self.replica.snapshots.detach()  # the outer step changes the state in place
        if self.pending:
            raise FailedPrecondition(
                f"the pool's average of the round ending at step {self.shared} has not arrived "
                f"here: the round ending at step {boundary} cannot take its outer step yet"
            )
        fresh = self.fresh_share(total_samples) if total_samples > 0 else None
        self.followed_step(boundary, fresh)
        if fresh is not None:  # for the replicas copying this one
            self.replica.updates.record(
                Update(boundary, fresh, total_samples, round_end=True, eager=EagerOp.STEP)
            )
        return False

    def followed_step(self, boundary: int, fresh: list[torch.Tensor] | None) -> None:
        """The outer step with the fresh share `fresh` (a copy takes its source's: its own
        samples in the round may be fewer, counted only since it copied)."""
        if fresh is not None:
            self._outer_step(eager_gradient(self.average, fresh, self.share), boundary)
            self.share, self.shared = fresh, boundary
        self._restart(boundary)

    def eager_part(self, boundary: int) -> list[torch.Tensor]:
        """The share the pool sums while the next round trains (`set_average` keeps the sum)."""
        if self.shared != boundary or self.share is None:
            raise FailedPrecondition(
                f"no share of the round ending at step {boundary} here (the last is of "
                f"{self.shared})"
            )
        return self.share

    def set_average(self, boundary: int, sums: list[torch.Tensor]) -> None:
        self.replica.snapshots.detach()  # a state being sent holds the last average
        if self.shared != boundary:
            raise FailedPrecondition(
                f"an average of the round ending at step {boundary} here, "
                f"whose last share is of {self.shared}"
            )
        assert self.share is not None
        owned = {id(t) for t in self.share}  # a pool of one sums nothing: keep no alias
        self.average = [t.clone() if id(t) in owned else t for t in sums]
        self.averaged = boundary
        self.replica.updates.record(
            Update(
                self.replica.step, sums, 0, round_end=True, eager=EagerOp.AVERAGE, boundary=boundary
            )
        )

    def last_part(self, boundary: int, total_samples: int) -> list[torch.Tensor]:
        """The job's last round (waited for): the fresh share, for the pool to sum now."""
        self._at(boundary)
        if self.pending:
            raise FailedPrecondition(f"the average of the round ending at {self.shared} is due")
        return self.fresh_share(total_samples)

    def set_last(self, boundary: int, sums: list[torch.Tensor], total_samples: int) -> None:
        self._at(boundary)
        self._last = (boundary, sums, total_samples)

    def last_step(self, boundary: int) -> bool:
        """The last round's outer step with the pool's whole sum of fresh shares; True when it
        was applied before."""
        if self.ended(boundary):
            return True
        self.replica.snapshots.detach()
        self._at(boundary)
        if self._last is None or self._last[0] != boundary:
            raise FailedPrecondition(f"the round ending at step {boundary} was not prepared")
        _, whole, total = self._last
        if total > 0:
            fresh = self.fresh_share(total)
            self._outer_step(eager_gradient(self.average, whole, self.share), boundary)
            self.share, self.shared = fresh, boundary
            self.average, self.averaged = whole, boundary
        self._last = None
        self._restart(boundary)
        return False

    def mean_part(self, boundary: int) -> list[torch.Tensor]:
        r = self.replica
        if not (boundary == r.step and self.ended(boundary)):
            raise FailedPrecondition(
                f"stage {r.stage}: the last round ({boundary}) is not "
                f"applied here (at step {r.step})"
            )
        return self.start

    def set_mean(self, sums: list[torch.Tensor], members: int) -> None:
        """The trained model: the members' round starts, summed in the group's order, over
        their number. Only the parameters take it (a retry with fewer members starts again
        from the starts)."""
        self.replica.snapshots.detach()
        with torch.no_grad():
            for p, total in zip(self.params, sums, strict=True):
                p.copy_(total.div_(members))

    # -- a copy following its source ------------------------------------------------------------
    def _follow_average(self, boundary: int, sums: list[torch.Tensor]) -> None:
        if self.averaged < boundary:
            self.set_average(boundary, self._on_device(sums))

    def _follow_step(self, step: int, sums: list[torch.Tensor], total_samples: int) -> None:
        if not self.ended(step):
            self._at(step)  # refused before anything is recorded or detached
            fresh = self._on_device(sums)
            self.replica.updates.record(
                Update(step, fresh, total_samples, round_end=True, eager=EagerOp.STEP)
            )
            self.replica.snapshots.detach()
            self.followed_step(step, fresh)

    # -- state ----------------------------------------------------------------------------------
    def export(self, names: list[str]) -> dict[str, torch.Tensor]:
        state = super().export(names)
        state[SHARED] = torch.tensor([self.shared], dtype=torch.int64)
        state[AVERAGED] = torch.tensor([self.averaged], dtype=torch.int64)
        for prefix, tensors in (("share", self.share), ("average", self.average)):
            for n, t in zip(names, tensors or [], strict=False):
                state[f"{prefix}/{n}"] = t.detach().cpu().clone()
        return state

    def check(self, names: list[str], state: dict[str, torch.Tensor], step: int) -> None:
        for prefix, marker in (("share", SHARED), ("average", AVERAGED)):
            at = state.get(marker)
            whole = all(f"{prefix}/{n}" in state for n in names)
            if at is not None and int(at.item()) >= 0 and not whole:
                raise InvalidArgument(f"a state of round {int(at.item())} without all {prefix}/")

    def load(self, names: list[str], state: dict[str, torch.Tensor], step: int) -> None:
        self.check(names, state, step)
        super().load(names, state, step)
        self._last = None
        self.share, self.shared = self._loaded(names, state, "share", SHARED)
        self.average, self.averaged = self._loaded(names, state, "average", AVERAGED)

    def _loaded(
        self, names: list[str], state: dict[str, torch.Tensor], prefix: str, marker: str
    ) -> tuple[list[torch.Tensor] | None, int]:
        """`prefix/` tensors of `state` (every parameter's, or none) and the round they are of."""
        at = state.get(marker)
        found = [state.get(f"{prefix}/{n}") for n in names]
        if at is None or any(t is None for t in found):
            if at is not None and int(at.item()) >= 0:
                raise InvalidArgument(f"a state of round {int(at.item())} without all {prefix}/")
            return None, -1
        return [
            t.to(p.device, p.dtype).clone()
            for t, p in zip(found, self.params, strict=True)
            if t is not None
        ], int(at.item())


class StepEagerRound(EagerRound):
    """delayed_update's eager rule: a round of one step on the parameters themselves, its share
    the step's gradient sums (`grads`, kept by `keeps`) over the pool's samples, its outer step
    the job's optimizer at the step the round ends after. No start (but the last step's, for
    the members' mean) and no outer optimizer."""

    def __init__(self, job: JobConfig, replica: Replica) -> None:
        super().__init__(job, replica)
        self.optimizer = replica.optimizer
        self.grads: list[torch.Tensor] | None = None

    def _first_start(self) -> tuple[list[torch.Tensor], torch.optim.Optimizer | None]:
        return [], None

    def keeps(self, grad_sums: list[torch.Tensor], samples: int) -> bool:
        """A step's APPLY keeps this replica's gradient sums of the step (its `samples`) for
        the step's end, which applies them (`eager_step`)."""
        self.grads = grad_sums if samples > 0 else None
        self.samples += samples
        return True

    def fresh_share(self, total_samples: int) -> list[torch.Tensor]:
        """Its gradient sums of the step / the step's `total_samples` (zeros if none)."""
        with torch.no_grad():
            if self.grads is None:
                return [torch.zeros_like(p) for p in self.params]
            return [s / total_samples for s in self.grads]

    def _outer_step(self, grad: list[torch.Tensor] | None, boundary: int) -> None:
        """Step `boundary - 1`'s update with `grad` (the last step's average plus this
        replica's fresh share minus its last share)."""
        assert grad is not None
        for p, g in zip(self.params, grad, strict=True):
            p.grad = g
        update(self.optimizer, self.job, boundary - 1)

    def _restart(self, boundary: int) -> None:
        """The next round begins (on the parameters as they are)."""
        self.samples, self.synced, self._prepared, self.grads = 0, boundary, None, None

    def last_step(self, boundary: int) -> bool:
        if super().last_step(boundary):
            return True
        self.start = [p.detach().clone() for p in self.params]  # what the members' mean sums
        return False

    def _export_start(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {}

    def _load_start(self, names: list[str], state: dict[str, torch.Tensor]) -> None:
        self.start = []  # after the last step: a state from elsewhere now
        self.grads = None
