"""The `[model]` keys of a small stage boundary, checked together: `boundary_rank` (the subspace
boundary, `swarm.model.subspace`) with its fixed table's `boundary_table`, and
`boundary_bottleneck` (the learned one, `swarm.model.bottleneck`). A job gets a clear refusal,
never a silent full boundary: a width not below `d_model`, both kinds at once, or a table without
a subspace (which would change the fingerprint and nothing else)."""

from __future__ import annotations

import math
from typing import Protocol

from swarm.job.coerce import not_allowed

__all__ = ["DEFAULT_TABLE", "check_small_boundary"]

DEFAULT_TABLE = 0.1  # `boundary_table` unset: the std of the table's entries (docs/compression.md)


class _Model(Protocol):  # `swarm.job.schema.ModelConfig`, which imports this module
    @property
    def d_model(self) -> int: ...
    @property
    def boundary_rank(self) -> int: ...
    @property
    def boundary_table(self) -> float: ...
    @property
    def boundary_bottleneck(self) -> int: ...


def check_small_boundary(model: _Model) -> None:
    """Raise ConfigError (naming the key) unless `model`'s small-boundary keys agree."""
    for key in ("boundary_rank", "boundary_bottleneck"):
        if getattr(model, key) >= model.d_model:
            allowed = f"0 (the full boundary) or 1..{model.d_model - 1} (below model.d_model)"
            raise not_allowed(f"model.{key}", getattr(model, key), allowed)
    if model.boundary_rank and model.boundary_bottleneck:
        allowed = "0 with model.boundary_rank (one small boundary at a time)"
        raise not_allowed("model.boundary_bottleneck", model.boundary_bottleneck, allowed)
    table = model.boundary_table
    if not math.isfinite(table) or (table != DEFAULT_TABLE and not model.boundary_rank):
        allowed = "a finite std >= 0, set with model.boundary_rank"
        raise not_allowed("model.boundary_table", table, allowed)
