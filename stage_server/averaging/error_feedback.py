"""Error feedback for a pool's lossy averaging: what a codec dropped from one step's round is added
to the next step's values before they are encoded, so quantization error is delayed, not lost
(error-feedback SGD: Seide et al. 2014, Karimireddy et al. 2019).

A round (`stage_server.averaging.butterfly.all_reduce`) loses precision in two places: every
contribution a
replica sends (its own included: it makes the same round trip), and every sum an owner encodes
once for the whole group. A replica keeps a residual for each, as flat tensors the size of the
gradient: `sent` over all of it, `summed` over the part it owned (zero elsewhere). Without them an
absmax codec rounds every value smaller than half a step of its block to zero at every step, so a
parameter whose gradient is small beside its block's largest never moves; with them it moves late.

A step's residuals count once that step applies (`commit`): an aborted round, retried with another
group, starts again from the residuals of the step before. They serve only the step right after
theirs, on the same job and stage: a rollback, a join, a move or a restart starts from none. They
live in memory only; a replica that dies loses at most one step's quantization error with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ErrorFeedback", "Residuals"]


@dataclass
class Residuals:
    """What one round's encodings dropped: `sent` from this replica's contributions, `summed` from
    the sums it owned. `all_reduce` reads them and, once the round completed, replaces both."""

    sent: torch.Tensor
    summed: torch.Tensor


@dataclass(frozen=True)
class _Held:
    job: str
    stage: int
    step: int
    residuals: Residuals


class ErrorFeedback:
    """A replica's residuals: those of the last applied step, and those of a prepared round."""

    def __init__(self) -> None:
        self._applied: _Held | None = None
        self._prepared: _Held | None = None

    def start(self, job: str, stage: int, step: int, flat: torch.Tensor) -> Residuals:
        """The residuals a round of `step` over `flat` starts from: the applied step's if it is
        `step - 1` of the same job, stage and gradient, else zeros. A new `Residuals` over the
        held tensors, not copies: `all_reduce` only reads them and replaces the fields, so an
        aborted round leaves what is held as it was."""
        held = self._applied
        if (
            held is not None
            and (held.job, held.stage, held.step) == (job, stage, step - 1)
            and held.residuals.sent.shape == flat.shape
            and held.residuals.sent.dtype == flat.dtype
        ):
            return Residuals(held.residuals.sent, held.residuals.summed)
        zeros = torch.zeros(flat.shape, dtype=flat.dtype)  # on the CPU, where parts are encoded
        return Residuals(zeros, zeros.clone())

    def prepared(self, job: str, stage: int, step: int, residuals: Residuals) -> None:
        """A round of `step` completed with these residuals; a later round of it replaces them."""
        self._prepared = _Held(job, stage, step, residuals)

    def applied(self, job: str, stage: int, step: int) -> None:
        """`step` applied: its prepared residuals serve the next step's round."""
        held = self._prepared
        if held is not None and (held.job, held.stage, held.step) == (job, stage, step):
            self._applied, self._prepared = held, None
