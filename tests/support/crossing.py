"""A microbatch as the first stage takes it (`swarm.wire.crossing.Crossing`): the runtime's and
the stage client's calls take what crosses into a stage as one value, and at stage 0 that is the
token ids alone."""

from __future__ import annotations

import torch

from swarm.wire.crossing import Crossing

__all__ = ["first_stage"]


def first_stage(
    batch: tuple[torch.Tensor, torch.Tensor],
) -> tuple[Crossing[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`batch` (token ids, labels) as stage 0 takes it: the ids crossing in, and the labels (a
    one-stage job's targets)."""
    ids, labels = batch
    return Crossing(ids), labels
