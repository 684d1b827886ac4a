"""A replica's round with `pool.mode = "local"` (DiLoCo): between two rounds the replica applies
the job's optimizer every step to its own samples (`StageRuntime.apply_update`); at a round's end
(boundary `s`: every `sync_every` steps, and after the job's last step) the pool averages the
replicas' pseudo-gradients, the parameters at the round's start minus their own, weighted by the
samples each took, and every replica applies the same outer step (SGD, Nesterov momentum) to the
round's start parameters and continues from them. The rule is `swarm.model.local_steps`'s, the
reference; the same operations in the same order keep replicas and reference bitwise together.

The round's start parameters and the outer momentum are the pool's (every member holds the same);
the inner optimizer's state is each replica's own. Both travel with a replica's state
(`round/<name>`, `outer/<name>`): checkpoints and rollbacks keep the round as it was.

With `pool.overlap = "eager"` nothing waits for the average (`eager_step`): at a round's end the
replica takes the outer step at once with the pool's average of the round before plus its own
fresh share minus its own share of the round before (`eager_gradient`, the reference's rule),
and the pool sums the fresh shares while the next round trains (`set_average`), for the next
round's end. Its start, outer momentum, last share and that average are its own (the members
differ by their shares) and travel with its state too (`share/`, `average/`, and which round
each is of). The job's last round is waited for (`last_part`, `last_step`: the whole average
instead of the own share) and the trained model is the members' mean (`mean_part`,
`set_mean`).

delayed_update's eager rule (`pool.mode = "step"`, `overlap = "eager"`, `step_eager`) is a round
of one step whose outer step is the job's optimizer (`inner`) on the parameters themselves: a
step's APPLY only keeps the replica's gradient sums (`stash`); its share is those sums over the
pool's samples of the step at this stage, and there is no start or outer optimizer of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import IntEnum

import torch

from swarm.errors import FailedPrecondition, InvalidArgument
from swarm.job.config import JobConfig
from swarm.job.rule import rule_of
from swarm.model.outer_rules import build_outer_optimizer, eager_gradient

__all__ = ["AVERAGED", "SHARED", "SYNCED", "Eager", "LocalRound"]

SYNCED = "round/synced"  # a state's one-value tensor: the last round's end it applied
SHARED = "round/shared"  # pool.overlap = "eager": the round's end of its `share/` tensors
AVERAGED = "round/averaged"  # ... and of its `average/` tensors


class Eager(IntEnum):
    """What a round's end asks of a replica with pool.overlap = "eager" (the wire's `EagerOp`,
    value for value: protos/swarm/proto/stage.proto says what each does)."""

    NONE = 0
    STEP = 1
    AVERAGE = 2
    LAST = 3
    MEAN = 4


# step_eager's outer step: the job's optimizer on `params` with this gradient, at this step
Inner = Callable[[list[torch.Tensor], int], None]


class LocalRound:
    def __init__(
        self, job: JobConfig, params: Sequence[torch.Tensor], inner: Inner | None = None
    ) -> None:
        self.params = list(params)
        pool = job.pool  # the outer optimizer's settings
        # step_eager: a round of one step on the parameters themselves (`inner`), its share the
        # step's gradient sums (`grads`, kept by `stash`) over the pool's samples
        self.gradients = rule_of(job).step_eager
        self.inner = inner
        self.grads: list[torch.Tensor] | None = None
        # The round's start: leaves of their own (an optimizer needs leaves), never views of
        # the parameters. step_eager has none (but the last step's, for the members' mean).
        self.start = [] if self.gradients else [p.detach().clone() for p in params]
        self.outer = build_outer_optimizer(self.start, pool) if self.start else None
        self.samples = 0  # this replica's samples in the round so far (its weight)
        self.synced = -1  # the boundary whose outer step was applied last
        # (boundary, the pool's averaged pseudo-gradient, its samples) between prepare and apply
        self._prepared: tuple[int, list[torch.Tensor], int] | None = None
        # pool.overlap = "eager": this replica's share of the round that ended at `shared`, and
        # the pool's sum of the shares of the round that ended at `averaged` (-1, None: none yet)
        self.eager = rule_of(job).eager
        self.share: list[torch.Tensor] | None = None
        self.shared = -1
        self.average: list[torch.Tensor] | None = None
        self.averaged = -1
        # the last round's (boundary, the pool's whole sum of fresh shares, its samples)
        self._last: tuple[int, list[torch.Tensor], int] | None = None

    def pseudo_gradient(self) -> list[torch.Tensor]:
        """This replica's part of the round's average: (start - parameters) x its samples."""
        n = float(self.samples)
        with torch.no_grad():
            return [(s - p.detach()).mul_(n) for s, p in zip(self.start, self.params, strict=True)]

    def set_prepared(self, boundary: int, sums: list[torch.Tensor], total_samples: int) -> None:
        self._prepared = (boundary, sums, total_samples)

    def prepared(self, boundary: int) -> tuple[list[torch.Tensor], int] | None:
        """The pool's summed pseudo-gradient and its samples, prepared for `boundary`."""
        if self._prepared is None or self._prepared[0] != boundary:
            return None
        return self._prepared[1], self._prepared[2]

    def apply(self, boundary: int) -> bool:
        """The outer step of the round ending at `boundary`; True when it was applied before."""
        if self.synced >= boundary:
            return True
        if self._prepared is None or self._prepared[0] != boundary:
            raise FailedPrecondition(f"the round ending at step {boundary} was not prepared")
        _, sums, total = self._prepared
        self.outer_step(boundary, sums, total)
        return False

    def outer_step(self, boundary: int, sums: list[torch.Tensor], total_samples: int) -> None:
        """Apply the pool's summed pseudo-gradient `sums` of `total_samples` samples: the outer
        step (none when the pool took no sample), then every parameter from the new start."""
        if total_samples > 0:
            for s, g in zip(self.start, sums, strict=True):
                s.grad = g.div_(total_samples)  # the pool's own copy: divided in place
            self._outer_step(None, boundary)
        self._restart(boundary)

    # -- pool.overlap = "eager" -----------------------------------------------------------------
    @property
    def pending(self) -> bool:
        """Whether the pool's sum of this replica's last share has not arrived yet."""
        return self.shared > self.averaged

    def stash(self, grad_sums: list[torch.Tensor], samples: int) -> None:
        """step_eager: a step's APPLY keeps this replica's gradient sums of the step (its
        `samples`) for the step's end, which applies them (`eager_step`)."""
        self.grads = grad_sums if samples > 0 else None
        self.samples += samples

    def fresh_share(self, total_samples: int) -> list[torch.Tensor]:
        """This replica's share of the round's pseudo-gradient: (start - parameters) x its
        samples / the round's `total_samples` (the reference's expression, bit for bit);
        step_eager: its gradient sums of the step / the step's `total_samples` (zeros if none)."""
        if self.gradients:
            with torch.no_grad():
                if self.grads is None:
                    return [torch.zeros_like(p) for p in self.params]
                return [s / total_samples for s in self.grads]
        ratio = self.samples / total_samples
        with torch.no_grad():
            return [(s - p.detach()) * ratio for s, p in zip(self.start, self.params, strict=True)]

    def eager_step(self, boundary: int, total_samples: int) -> list[torch.Tensor] | None:
        """The outer step of the round ending at `boundary`, at once: the last average plus the
        fresh share minus the last share. Returns the fresh share (None when the pool took no
        sample: nothing moves then but the parameters back to the start)."""
        if self.pending:
            raise FailedPrecondition(
                f"the pool's average of the round ending at step {self.shared} has not arrived "
                f"here: the round ending at step {boundary} cannot take its outer step yet"
            )
        fresh = self.fresh_share(total_samples) if total_samples > 0 else None
        self.followed_step(boundary, fresh)
        return fresh

    def followed_step(self, boundary: int, fresh: list[torch.Tensor] | None) -> None:
        """The outer step with the fresh share `fresh` (a copy takes its source's: its own
        samples in the round may be fewer, counted only since it copied)."""
        if fresh is not None:
            self._outer_step(eager_gradient(self.average, fresh, self.share), boundary)
            self.share, self.shared = fresh, boundary
        self._restart(boundary)

    def shared_part(self, boundary: int) -> list[torch.Tensor]:
        """The share the pool sums while the next round trains (`set_average` keeps the sum)."""
        if self.shared != boundary or self.share is None:
            raise FailedPrecondition(
                f"no share of the round ending at step {boundary} here (the last is of "
                f"{self.shared})"
            )
        return self.share

    def set_average(self, boundary: int, sums: list[torch.Tensor]) -> None:
        """The pool's sum of the shares of the round ending at `boundary` arrived."""
        if self.shared != boundary:
            raise FailedPrecondition(f"an average of the round ending at step {boundary} here, "
                                     f"whose last share is of {self.shared}")  # fmt: skip
        assert self.share is not None
        owned = {id(t) for t in self.share}  # a pool of one sums nothing: keep no alias
        self.average = [t.clone() if id(t) in owned else t for t in sums]
        self.averaged = boundary

    def last_part(self, boundary: int, total_samples: int) -> list[torch.Tensor]:
        """The job's last round (waited for): the fresh share, for the pool to sum now."""
        if self.pending:
            raise FailedPrecondition(f"the average of the round ending at {self.shared} is due")
        return self.fresh_share(total_samples)

    def set_last(self, boundary: int, sums: list[torch.Tensor], total_samples: int) -> None:
        self._last = (boundary, sums, total_samples)

    def last_step(self, boundary: int) -> bool:
        """The last round's outer step with the pool's whole sum of fresh shares; True when it
        was applied before."""
        if self.synced >= boundary:
            return True
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
        if self.gradients:  # what the members' mean sums (a retry of it, too)
            self.start = [p.detach().clone() for p in self.params]
        return False

    def set_mean(self, sums: list[torch.Tensor], members: int) -> None:
        """The trained model: the members' round starts, summed in the group's order, over
        their number. Only the parameters take it (a retry with fewer members starts again
        from the starts)."""
        with torch.no_grad():
            for p, total in zip(self.params, sums, strict=True):
                p.copy_(total.div_(members))

    def _outer_step(self, grad: list[torch.Tensor] | None, boundary: int) -> None:
        """The outer step with `grad` (None: the start's `.grad` is set already); step_eager:
        the job's optimizer at the step the round ends after."""
        if self.gradients:
            assert self.inner is not None and grad is not None
            self.inner(grad, boundary - 1)
            return
        assert self.outer is not None
        if grad is not None:
            for s, g in zip(self.start, grad, strict=True):
                s.grad = g
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)

    def _restart(self, boundary: int) -> None:
        """Every parameter from the (new) start; the next round begins."""
        if not self.gradients:
            with torch.no_grad():
                for p, s in zip(self.params, self.start, strict=True):
                    p.copy_(s)
        self.samples, self.synced, self._prepared, self.grads = 0, boundary, None, None

    # -- state ----------------------------------------------------------------------------------
    def export(self, names: list[str]) -> dict[str, torch.Tensor]:
        """`round/<name>` (the start) and `outer/<name>` (the momentum, once there is one)."""
        state = {}
        if self.outer is not None:  # not step_eager's
            for n, s in zip(names, self.start, strict=True):
                state[f"round/{n}"] = s.detach().cpu().clone()
                buf = self.outer.state.get(s, {}).get("momentum_buffer")
                if buf is not None:
                    state[f"outer/{n}"] = buf.detach().cpu().clone()
        # The last round's end applied here: a state taken between a round's last local step
        # and its end is not yet the round's start.
        state[SYNCED] = torch.tensor([self.synced], dtype=torch.int64)
        if self.eager:
            state[SHARED] = torch.tensor([self.shared], dtype=torch.int64)
            state[AVERAGED] = torch.tensor([self.averaged], dtype=torch.int64)
            for prefix, tensors in (("share", self.share), ("average", self.average)):
                for n, t in zip(names, tensors or [], strict=False):
                    state[f"{prefix}/{n}"] = t.detach().cpu().clone()
        return state

    def load(self, names: list[str], state: dict[str, torch.Tensor], step: int) -> None:
        """From a state `export` wrote at `step` (a state without `round/`, a checkpoint's or
        the initial one: a round starts here)."""
        if self.outer is not None:  # not step_eager's
            with torch.no_grad():
                for n, s, p in zip(names, self.start, self.params, strict=True):
                    s.copy_(state.get(f"round/{n}", p.detach()))
            self.outer.state.clear()
            for n, s in zip(names, self.start, strict=True):
                buf = state.get(f"outer/{n}")
                if buf is not None:
                    self.outer.state[s] = {"momentum_buffer": buf.to(s.device, s.dtype).clone()}
        elif self.start:  # step_eager after the last step: a state from elsewhere now
            self.start = []
        synced = state.get(SYNCED)
        self.synced = int(synced.item()) if synced is not None else step
        self.samples, self._prepared, self._last, self.grads = 0, None, None, None
        if self.eager:
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
        return [t.to(p.device, p.dtype).clone() for t, p in zip(found, self.params, strict=True)
                if t is not None], int(at.item())  # fmt: skip
