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

The eager rounds (`pool.overlap = "eager"`, and delayed_update's eager rule) build on this one:
`stage_server.replica.eager_round`.
"""

from __future__ import annotations

import torch

from stage_server.replica.no_round import NoRound, Replica
from swarm.errors import FailedPrecondition
from swarm.job.config import JobConfig
from swarm.model.optim import is_boundary
from swarm.model.outer_rules import build_outer_optimizer
from swarm.rpc.state_streams import Update

__all__ = ["AVERAGED", "SHARED", "SYNCED", "LocalRound"]

SYNCED = "round/synced"  # a state's one-value tensor: the last round's end it applied
SHARED = "round/shared"  # pool.overlap = "eager": the round's end of its `share/` tensors
AVERAGED = "round/averaged"  # ... and of its `average/` tensors


class LocalRound(NoRound):
    EMPTY_STEPS = True  # a local step of a replica that took no sample moves nothing

    def __init__(self, job: JobConfig, replica: Replica) -> None:
        super().__init__(job, replica)
        self.params = list(replica.params)
        # The round's start: leaves of their own (an optimizer needs leaves), never views of
        # the parameters; and the outer optimizer over it.
        self.start, self.outer = self._first_start()
        # (boundary, the pool's averaged pseudo-gradient, its samples) between prepare and apply
        self._prepared: tuple[int, list[torch.Tensor], int] | None = None

    def _first_start(self) -> tuple[list[torch.Tensor], torch.optim.Optimizer | None]:
        start = [p.detach().clone() for p in self.params]
        return start, build_outer_optimizer(start, self.job.pool)

    def _at(self, boundary: int) -> None:
        """A round of this replica's ends at `boundary`, or FailedPrecondition."""
        r = self.replica
        if boundary != r.step or not is_boundary(self.job, boundary):
            raise FailedPrecondition(
                f"stage {r.stage} is at step {r.step}: no round of it ends at {boundary}"
            )

    def ended(self, boundary: int) -> bool:
        return self.synced >= boundary

    def copy_step(self, step: int) -> int:
        """A round ends at `step` that this replica has not applied yet: a copy at `step - 1`."""
        return step - 1 if is_boundary(self.job, step) and not self.ended(step) else step

    def took(self, samples: int) -> None:
        self.samples += samples

    def pseudo_gradient(self) -> list[torch.Tensor]:
        """This replica's part of the round's average: (start - parameters) x its samples."""
        n = float(self.samples)
        with torch.no_grad():
            return [(s - p.detach()).mul_(n) for s, p in zip(self.start, self.params, strict=True)]

    # -- a round's end --------------------------------------------------------------------------
    def prepare(self, boundary: int) -> list[torch.Tensor]:
        self.replica.following = False  # a member now: its updates come from its own pool
        self._at(boundary)
        return self.pseudo_gradient()

    def set_prepared(self, boundary: int, sums: list[torch.Tensor], total_samples: int) -> None:
        self._at(boundary)
        self._prepared = (boundary, sums, total_samples)

    def apply(self, boundary: int) -> bool:
        if self.ended(boundary):
            return True
        self._at(boundary)
        prepared = self._prepared
        if prepared is None or prepared[0] != boundary:
            self.replica.snapshots.detach()
            raise FailedPrecondition(f"the round ending at step {boundary} was not prepared")
        _, sums, total = prepared
        # for the replicas copying this one, before it is divided
        self.replica.updates.record(Update(boundary, sums, total, round_end=True))
        self.replica.snapshots.detach()  # the outer step changes the state in place
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

    def _outer_step(self, grad: list[torch.Tensor] | None, boundary: int) -> None:
        """The outer step with `grad` (None: the start's `.grad` is set already)."""
        assert self.outer is not None
        if grad is not None:
            for s, g in zip(self.start, grad, strict=True):
                s.grad = g
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)

    def _restart(self, boundary: int) -> None:
        """Every parameter from the (new) start; the next round begins."""
        with torch.no_grad():
            for p, s in zip(self.params, self.start, strict=True):
                p.copy_(s)
        self.samples, self.synced, self._prepared = 0, boundary, None

    def set_last(self, boundary: int, sums: list[torch.Tensor], total_samples: int) -> None:
        raise self._not_eager()  # a plain round has no last round of its own

    def _follow_end(self, step: int, sums: list[torch.Tensor], total_samples: int) -> None:
        sums = self._on_device(sums)
        self.replica.updates.record(Update(step, sums, total_samples, round_end=True))  # followers
        self.replica.snapshots.detach()  # the outer step changes the state in place
        self._at(step)
        self.outer_step(step, sums, total_samples)

    # -- state ----------------------------------------------------------------------------------
    def export(self, names: list[str]) -> dict[str, torch.Tensor]:
        """`round/<name>` (the start) and `outer/<name>` (the momentum, once there is one), and
        the last round's end applied here: a state taken between a round's last local step and
        its end is not yet the round's start."""
        state = self._export_start(names)
        state[SYNCED] = torch.tensor([self.synced], dtype=torch.int64)
        return state

    def _export_start(self, names: list[str]) -> dict[str, torch.Tensor]:
        assert self.outer is not None
        state = {}
        for n, s in zip(names, self.start, strict=True):
            state[f"round/{n}"] = s.detach().cpu().clone()
            buf = self.outer.state.get(s, {}).get("momentum_buffer")
            if buf is not None:
                state[f"outer/{n}"] = buf.detach().cpu().clone()
        return state

    def load(self, names: list[str], state: dict[str, torch.Tensor], step: int) -> None:
        """From a state `export` wrote at `step` (a state without `round/`, a checkpoint's or
        the initial one: a round starts here)."""
        self._load_start(names, state)
        synced = state.get(SYNCED)
        self.synced = int(synced.item()) if synced is not None else step
        self.samples, self._prepared = 0, None

    def _load_start(self, names: list[str], state: dict[str, torch.Tensor]) -> None:
        assert self.outer is not None
        with torch.no_grad():
            for n, s, p in zip(names, self.start, self.params, strict=True):
                s.copy_(state.get(f"round/{n}", p.detach()))
        self.outer.state.clear()
        for n, s in zip(names, self.start, strict=True):
            buf = state.get(f"outer/{n}")
            if buf is not None:
                self.outer.state[s] = {"momentum_buffer": buf.to(s.device, s.dtype).clone()}
