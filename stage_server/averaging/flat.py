"""The flat gradient a round averages: a stage's tensors as one 1-D tensor (a view where they lie
one after another, as a replica's sums do), views back in their shapes, and the contiguous parts
the pool's members own."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarm.errors import ConfigError, InvalidArgument
from swarm.model.flat import flat_view  # re-exported: the averaging's readers ask it here

__all__ = ["flat_view", "flatten", "split_parts", "unflatten"]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """`tensors` (which must share one dtype and device) as one contiguous 1-D tensor: a view
    when they lie one after another in one memory (as `StageRuntime.prepare` gives them), else
    a copy."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise InvalidArgument(f"flatten needs tensors of one dtype, got {sorted(map(str, dtypes))}")
    whole = flat_view(tensors)
    if whole is not None:
        return whole
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` shaped like `like` (no copy: writing to one writes to `flat`)."""
    sizes = [t.numel() for t in like]
    if flat.dim() != 1 or flat.numel() != sum(sizes):
        raise InvalidArgument(f"flat {list(flat.shape)} does not hold {sum(sizes)} elements")
    return [p.view(t.shape) for p, t in zip(torch.split(flat, sizes), like, strict=True)]


def split_parts(numel: int, n: int) -> list[slice]:
    """`n` contiguous parts of `range(numel)`, the first `numel % n` one element longer."""
    if n < 1 or numel < 0:
        raise ConfigError(f"cannot split {numel} elements into {n} parts; need n >= 1")
    q, r = divmod(numel, n)
    bounds = [k * q + min(k, r) for k in range(n + 1)]
    return [slice(bounds[k], bounds[k + 1]) for k in range(n)]
