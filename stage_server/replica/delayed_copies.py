"""The parameters each step computes on: the module itself, or (delayed_update's plain rule)
copies of it one update old.

With `training.delayed_update` a replica at step m (m updates applied) computes two steps at
once: step m, whose commit may still be averaging or replaying, on the parameters before
update m-1, and step m+1 on those after it (`Rule.computes_on`). The optimizer's own parameters
move on at each APPLY, so each step computes on a copy of the module at the version it needs,
which no update touches while graphs of its microbatches are cached. A whole state holds the
parameters step m computes on as `prev/<name>`: a copy must compute as its source does.

`NoCopies` is the plain rule's null object (every step on the module itself); `copies_for`
chooses once from the job's rule.
"""

from __future__ import annotations

import copy

import torch

from swarm.errors import FailedPrecondition, InvalidArgument
from swarm.job.config import JobConfig
from swarm.job.rule import rule_of
from swarm.model.optim import computes_on

__all__ = ["DelayedCopies", "NoCopies", "copies_for"]


class NoCopies:
    """Every step computes on the module itself, after every update before it."""

    ahead = 0  # how many steps past its own a replica computes

    def __init__(self, job: JobConfig, stage: int, module: torch.nn.Module) -> None:
        self.job, self.stage, self.module = job, stage, module
        self.params = list(module.parameters())  # the optimizer's

    def module_at(self, step: int, at: int) -> torch.nn.Module:
        """The module step `step` computes with (whose parameters it takes gradients of), on a
        replica at step `at`."""
        return self.module

    def params_at(self, step: int, at: int) -> list[torch.Tensor]:
        return list(self.params)

    def applied(self, step: int) -> None:
        """The update that moved the replica to `step` was applied."""

    def export(self, step: int) -> dict[str, torch.Tensor]:
        """What a whole state of a replica at `step` holds besides its module and optimizer."""
        return {}

    def check(self, step: int, state: dict[str, torch.Tensor]) -> None:
        """What `load` would refuse of `state` at `step`, refused before anything is loaded."""

    def load(self, step: int, state: dict[str, torch.Tensor]) -> None:
        """The copies a replica at `step` computes on, from a whole state (after the module)."""


class DelayedCopies(NoCopies):
    """delayed_update: updates applied -> a copy of the module then, for `step - 1` (what step
    `step` computes on) and `step` (what step `step + 1` computes on)."""

    ahead = 1

    def __init__(self, job: JobConfig, stage: int, module: torch.nn.Module) -> None:
        super().__init__(job, stage, module)
        self._versions: dict[int, torch.nn.Module] = {0: self._copy()}

    def _copy(self, into: torch.nn.Module | None = None) -> torch.nn.Module:
        """A copy of the module with the optimizer's parameters now (`into`, an unused copy, is
        overwritten rather than a new one made)."""
        if into is None:
            return copy.deepcopy(self.module)
        with torch.no_grad():
            for q, p in zip(into.parameters(), self.params, strict=True):
                q.copy_(p)
        return into

    def module_at(self, step: int, at: int) -> torch.nn.Module:
        module = self._versions.get(computes_on(self.job, step))
        if module is None:
            raise FailedPrecondition(
                f"stage {self.stage} at step {at} no longer holds the parameters step "
                f"{step} computes on"
            )
        return module

    def params_at(self, step: int, at: int) -> list[torch.Tensor]:
        return list(self.module_at(step, at).parameters())

    def applied(self, step: int) -> None:
        # step + 1 computes on these; step - 1's copy is free for them
        unused = [v for v in self._versions if v < step - 1]
        spare = self._versions.pop(unused[0]) if unused else None
        for version in unused[1:]:
            del self._versions[version]
        self._versions[step] = self._copy(spare)

    def export(self, step: int) -> dict[str, torch.Tensor]:
        return {
            f"prev/{name}": p.detach().cpu().clone()
            for name, p in self.module_at(step, step).named_parameters()
        }

    def check(self, step: int, state: dict[str, torch.Tensor]) -> None:
        names = [name for name, _ in self.module.named_parameters()]
        if computes_on(self.job, step) != step and any(f"prev/{n}" not in state for n in names):
            raise InvalidArgument(
                f"stage {self.stage}: a delayed_update state of step {step} must hold the "
                "parameters before its last update (prev/<name>)"
            )

    def load(self, step: int, state: dict[str, torch.Tensor]) -> None:
        """The copies of the parameters steps `step` and `step + 1` compute on, from `state`
        (its `prev/` tensors; at step 0 they are the parameters themselves)."""
        self.check(step, state)
        current = self._copy()
        older = copy.deepcopy(self.module)
        with torch.no_grad():
            for name, p in older.named_parameters():
                prev = state.get(f"prev/{name}")
                if prev is None:
                    self._versions = {step: current}
                    return
                p.copy_(prev)
        self._versions = {computes_on(self.job, step): older, step: current}


def copies_for(job: JobConfig, stage: int, module: torch.nn.Module) -> NoCopies:
    """The parameters `job`'s steps compute on, chosen once from its rule."""
    kind = DelayedCopies if rule_of(job).delays else NoCopies
    return kind(job, stage, module)
