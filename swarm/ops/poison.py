"""A hostile replica, for tests and benchmarks: a stage server started with `SWARM_POISON` answers
finite wrong numbers, as a volunteer who lies would (issue 55). Not a fault that kills or raises
(`swarm.ops.faults`): the process serves on, and only an audit by re-execution can tell.

`SWARM_POISON="KIND[:PERIOD[:PHASE]]"`: KIND is `activations` (a Forward's outputs), `grads`
(the input gradient a Backward or ForwardBackward answers) or `sent-activations` (on the push
plane, the outputs sent on to the next stage, while the replica commits to the honest ones'
digest: a liar that says one thing and sends another); the steps poisoned are those with
`step % PERIOD == PHASE` (default every step). What is sent is the honest tensor plus up to
`ERROR` in every element, varying along it (`_wrong`): finite, small, far above any rounding, and
neither a constant shift nor a scaling, which the LayerNorm after a stage would undo."""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass

import torch

from swarm.errors import ConfigError

__all__ = ["ENV", "ERROR", "Kind", "Poison", "parse_poison"]

log = logging.getLogger(__name__)
ENV = "SWARM_POISON"
ERROR = 1e-2  # added to every element of a poisoned tensor


class Kind(enum.StrEnum):
    ACTIVATIONS = "activations"
    GRADS = "grads"
    SENT = "sent-activations"


@dataclass(frozen=True)
class Poison:
    """What this replica lies about, and when; `Poison()` lies about nothing."""

    kind: Kind | None = None
    period: int = 1
    phase: int = 0

    @classmethod
    def from_env(cls) -> Poison:
        text = os.environ.get(ENV, "")
        poison = parse_poison(text)
        if poison.kind is not None:
            log.warning("%s=%s: this replica answers wrong numbers", ENV, text)
        return poison

    def _due(self, kind: Kind, step: int) -> bool:
        return self.kind == kind and step % self.period == self.phase

    def outputs(self, step: int, tensor: torch.Tensor) -> torch.Tensor:
        """A Forward's outputs as this replica sends them."""
        return _wrong(tensor) if self._due(Kind.ACTIVATIONS, step) else tensor

    def sent(self, step: int, tensor: torch.Tensor) -> torch.Tensor | None:
        """The outputs this replica pushes on instead of those it commits to; None: the same."""
        return _wrong(tensor) if self._due(Kind.SENT, step) else None

    def grads(self, step: int, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """The input gradient as this replica sends it."""
        if tensor is None or not self._due(Kind.GRADS, step):
            return tensor
        return _wrong(tensor)


def _wrong(tensor: torch.Tensor) -> torch.Tensor:
    wave = torch.cos(torch.arange(tensor.numel(), dtype=torch.float64, device=tensor.device))
    return tensor + (ERROR * wave).to(tensor.dtype).reshape(tensor.shape)


def parse_poison(text: str) -> Poison:
    if not text:
        return Poison()
    kind, *rest = text.split(":")
    try:
        period, phase = (int(rest[0]) if rest else 1), (int(rest[1]) if len(rest) > 1 else 0)
        poison = Poison(Kind(kind), period, phase)
    except (ValueError, IndexError):
        poison = None
    if poison is None or len(rest) > 2 or period < 1 or not 0 <= phase < period:
        raise ConfigError(
            f"{ENV}={text!r}: use KIND[:PERIOD[:PHASE]], KIND one of "
            f"{', '.join(k.value for k in Kind)}, 0 <= PHASE < PERIOD"
        )
    return poison
