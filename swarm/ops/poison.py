"""A hostile replica's stage compute, for tests and benchmarks: a stage server whose `SWARM_FAULTS`
(`swarm.ops.faults`) holds `poison-outputs@S` or `poison-grad-inputs@S` (from step S on, or one
step in PERIOD with `@S/PERIOD`) answers finite wrong numbers, as a volunteer who lies would
(issue 55). The process serves on: only an audit by re-execution can tell.

`poison-outputs` lies about a Forward's outputs, `poison-grad-inputs` about the input gradient a
Backward or ForwardBackward answers, `poison-sent-outputs` (the push plane) about the outputs sent
on to the next stage while it commits to the honest ones' digest: a liar that says one thing and
sends another, `poison-digest` about the digest of a contribution's gradient it answers as an
auditor (`stage_server.replica.gradient_digest`; its re-execution and its answers honest): a
liar that blocks the audit of others' contributions. What is sent is the honest tensor plus up to
`ERROR` in every element, varying along it (`_wrong`): finite, small, far above any rounding,
and neither a constant shift nor a scaling, which the LayerNorm after a stage would undo."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from swarm.ops import faults
from swarm.ops.faults import Fault, Point

__all__ = ["ERROR", "Digest", "Poison"]

log = logging.getLogger(__name__)
Digest = tuple[float, float, float]  # a gradient's, as an audit answers it
ERROR = 1e-2  # added to every element of a poisoned tensor
_COMPUTE = (
    Point.POISON_OUTPUTS,
    Point.POISON_GRAD_INPUTS,
    Point.POISON_SENT_OUTPUTS,
    Point.POISON_DIGEST,
)


@dataclass(frozen=True)
class Poison:
    """What one replica lies about in its stage compute, and when (its hostile faults; servers
    sharing a process, as in tests, each hold their own); `Poison()` lies about nothing."""

    faults: tuple[Fault, ...] = ()

    @classmethod
    def of(cls, lies: Iterable[Fault]) -> Poison:
        return cls(tuple(f for f in lies if f.point in _COMPUTE))

    @classmethod
    def armed(cls) -> Poison:
        """This process's own (its SWARM_FAULTS)."""
        poison = cls.of(faults.armed())
        if poison.faults:
            lies = ", ".join(map(str, poison.faults))
            log.warning("%s: this replica answers wrong numbers", lies)
        return poison

    def _due(self, point: Point, step: int) -> bool:
        return any(f.hostile_at(point, step) for f in self.faults)

    def outputs(self, step: int, tensor: torch.Tensor) -> torch.Tensor:
        """A Forward's outputs as this replica sends them."""
        return _wrong(tensor) if self._due(Point.POISON_OUTPUTS, step) else tensor

    def sent(self, step: int, tensor: torch.Tensor) -> torch.Tensor | None:
        """The outputs this replica pushes on instead of those it commits to; None: the same."""
        return _wrong(tensor) if self._due(Point.POISON_SENT_OUTPUTS, step) else None

    def grads(self, step: int, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """The input gradient as this replica sends it."""
        if tensor is None or not self._due(Point.POISON_GRAD_INPUTS, step):
            return tensor
        return _wrong(tensor)

    def digest(self, step: int, digest: Digest | None) -> Digest | None:
        """A gradient's digest (r·g, Σ|r_i·g_i|, ‖g‖) as this replica answers it: r·g moved by
        `ERROR` of Σ|r_i·g_i|, far above any rounding of it."""
        if digest is None or not self._due(Point.POISON_DIGEST, step):
            return digest
        dot, magnitude, norm = digest
        return dot + ERROR * magnitude, magnitude, norm


def _wrong(tensor: torch.Tensor) -> torch.Tensor:
    wave = torch.cos(torch.arange(tensor.numel(), dtype=torch.float64, device=tensor.device))
    return tensor + (ERROR * wave).to(tensor.dtype).reshape(tensor.shape)
