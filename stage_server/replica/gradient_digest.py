"""The digest of one microbatch's parameter gradient, for an audit of a replica's contribution
(issue 55; docs/decisions.md, "The parameter-gradient audit"): r·g, Σ|r_i·g_i| and ‖g‖ over the
stage's flat vector, r drawn from the audit's seed as the round's checksums draw theirs
(`stage_server.averaging.checksum`). The flat vector is laid out as the replica's gradient sums
are (its parameters end to end, in order), so the digests of a replica's microbatches add up to
the checksum of its contribution, up to the rounding of its own accumulation."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch

from stage_server.averaging.checksum import dots
from stage_server.replica.step_sums import Receipt

__all__ = ["Digest", "backprop_apart", "digest"]

Digest = tuple[float, float, float]  # (r·g, Σ|r_i·g_i|, ‖g‖)


def digest(
    seed: int, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]
) -> Digest:
    """`grads` (of `params`, None where a parameter took none: zeros) digested with `seed`."""
    flat = torch.cat(
        [
            (torch.zeros_like(p) if g is None else g).detach().reshape(-1)
            for p, g in zip(params, grads, strict=True)
        ]
    )
    dot, magnitude, squares = dots(seed, 0, flat)
    return dot, magnitude, math.sqrt(squares)


def backprop_apart(
    params: list[torch.Tensor],
    x: torch.Tensor,
    out: torch.Tensor,
    grad: torch.Tensor | None,
    want_x: bool,
    receipt: Receipt,
    digest_seed: int,
) -> tuple[torch.Tensor | None, Receipt]:
    """A backward that accumulates nothing: the gradient of `x` when `want_x`, and `receipt`
    with the parameter gradient's digest where `digest_seed` asks for one (else not computed)."""
    targets = [*params, x] if want_x else params
    grads = torch.autograd.grad(out, targets, grad, allow_unused=True)
    if digest_seed:
        receipt = replace(receipt, digest=digest(digest_seed, params, grads[: len(params)]))
    return (grads[-1] if want_x else None), receipt
