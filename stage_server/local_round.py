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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarm.errors import FailedPrecondition
from swarm.job.config import JobConfig
from swarm.model.local_steps import build_outer_optimizer

__all__ = ["SYNCED", "LocalRound"]

SYNCED = "round/synced"  # a state's one-value tensor: the last round's end it applied


class LocalRound:
    def __init__(self, job: JobConfig, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        pool = job.pool
        # The round's start: leaves of their own (an optimizer needs leaves), never views of
        # the parameters.
        self.start = [p.detach().clone() for p in params]
        self.outer = build_outer_optimizer(self.start, pool)  # the reference's own
        self.samples = 0  # this replica's samples in the round so far (its weight)
        self.synced = -1  # the boundary whose outer step was applied last
        # (boundary, the pool's averaged pseudo-gradient, its samples) between prepare and apply
        self._prepared: tuple[int, list[torch.Tensor], int] | None = None

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
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, s in zip(self.params, self.start, strict=True):
                p.copy_(s)
        self.samples, self.synced, self._prepared = 0, boundary, None

    # -- state ----------------------------------------------------------------------------------
    def export(self, names: list[str]) -> dict[str, torch.Tensor]:
        """`round/<name>` (the start) and `outer/<name>` (the momentum, once there is one)."""
        state = {
            f"round/{n}": s.detach().cpu().clone() for n, s in zip(names, self.start, strict=True)
        }
        # The last round's end applied here: a state taken between a round's last local step
        # and its end is not yet the round's start.
        state[SYNCED] = torch.tensor([self.synced], dtype=torch.int64)
        for n, s in zip(names, self.start, strict=True):
            buf = self.outer.state.get(s, {}).get("momentum_buffer")
            if buf is not None:
                state[f"outer/{n}"] = buf.detach().cpu().clone()
        return state

    def load(self, names: list[str], state: dict[str, torch.Tensor], step: int) -> None:
        """From a state `export` wrote at `step` (a state without `round/`, a checkpoint's or
        the initial one: a round starts here)."""
        with torch.no_grad():
            for n, s, p in zip(names, self.start, self.params, strict=True):
                s.copy_(state.get(f"round/{n}", p.detach()))
        self.outer.state.clear()
        for n, s in zip(names, self.start, strict=True):
            buf = state.get(f"outer/{n}")
            if buf is not None:
                self.outer.state[s] = {"momentum_buffer": buf.to(s.device, s.dtype).clone()}
        synced = state.get(SYNCED)
        self.synced = int(synced.item()) if synced is not None else step
        self.samples, self._prepared = 0, None
