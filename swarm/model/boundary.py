"""How a job's stage boundary crosses: one strategy chosen once from the job (`boundary_of`), as
the training rule is (`swarm.job.rule.rule_of`), which the roles ask and never read the job's
`[model]` keys of it again. Only this package reads `model.boundary_rank` (tests/test_layering.py).

A full boundary (`d_model` features a token) and a learned bottleneck's (`boundary_bottleneck`
features) send the hidden state alone. The subspace boundary (`model.boundary_rank`,
`swarm.model.subspace`) sends a few coefficients a token, and the next stage rebuilds the
residual from them and the token ids: the ids cross beside the hidden state (in one
`swarm.wire.crossing.Crossing`), and the targets, which ride every hop of the push plane, go as
narrow as the ids."""

from __future__ import annotations

from functools import cache

import torch

from swarm.job.schema import ModelConfig
from swarm.model.subspace import wire_targets, wire_tokens
from swarm.model.transformer import boundary_width

__all__ = ["Boundary", "SubspaceBoundary", "boundary_of"]

_NARROW = (torch.uint8, torch.int32)  # the ids' types on the wire (`wire_tokens`)


class Boundary:
    """A boundary the hidden state crosses alone: full width, or a learned bottleneck's."""

    needs_tokens = False
    """Whether a stage after the first needs the microbatch's token ids beside its inputs."""

    def __init__(self, model: ModelConfig) -> None:
        self.width = boundary_width(model)  # features per token
        self.vocab = model.vocab_size

    def tokens(self, ids: torch.Tensor) -> torch.Tensor | None:
        """The token ids `ids` as they cross beside the hidden state; None: they do not."""
        return None

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        """The targets as every hop of the push plane carries them."""
        return labels

    def widened(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids or targets as a stage takes them in: int64, as they come here."""
        return ids

    def __str__(self) -> str:
        return f"a boundary of {self.width} features a token"


class SubspaceBoundary(Boundary):
    """`model.boundary_rank` coefficients a token, the token ids beside them (narrow, as the
    targets: `swarm.model.subspace.wire_tokens`)."""

    needs_tokens = True

    def __init__(self, model: ModelConfig) -> None:
        super().__init__(model)
        self.rank = model.boundary_rank

    def tokens(self, ids: torch.Tensor) -> torch.Tensor | None:
        return wire_tokens(ids, self.vocab)

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        return wire_targets(labels, self.rank, self.vocab)

    def widened(self, ids: torch.Tensor) -> torch.Tensor:
        return ids.long() if ids.dtype in _NARROW else ids

    def __str__(self) -> str:
        return f"model.boundary_rank = {self.rank}"


@cache
def boundary_of(model: ModelConfig) -> Boundary:
    """The boundary of a job whose `[model]` is `model` (one shared object per model)."""
    return SubspaceBoundary(model) if model.boundary_rank else Boundary(model)
