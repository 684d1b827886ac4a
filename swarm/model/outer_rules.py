"""The outer-step rules of pools that train with rounds (`pool.mode = "local"`, and the eager
rules): the pool's outer optimizer, a round's averaged pseudo-gradient, a member's eager outer
gradient and the fixed-order sum they rest on. The replicas (`stage_server.replica.eager_round`) and
the reference (`swarm.model.local_steps`) both take these very functions, so they compute the same
bits."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from swarm.job.config import PoolConfig

__all__ = [
    "build_outer_optimizer",
    "eager_gradient",
    "eager_gradients",
    "ordered_sum",
    "pseudo_gradient",
]


def build_outer_optimizer(params: Iterable[torch.Tensor], cfg: PoolConfig) -> torch.optim.Optimizer:
    """The pool's outer SGD on a round's start parameters: Nesterov momentum, or plain SGD with
    momentum 0 (torch refuses Nesterov without momentum). foreach=False, as `build_optimizer`."""
    momentum = cfg.outer_momentum
    return torch.optim.SGD(
        params, lr=cfg.outer_lr, momentum=momentum, nesterov=momentum > 0, foreach=False
    )


def pseudo_gradient(
    start: Sequence[torch.Tensor], members: Sequence[tuple[Sequence[torch.Tensor], int]]
) -> list[torch.Tensor] | None:
    """A round's averaged pseudo-gradient, per parameter: sum over `members` (parameters, round
    samples), in their order, of (start - parameters) * samples, then divided by the total
    samples; None when no member counted a sample (no outer step then). The order of the sum
    is the group's, so every replica and the reference get the same bits."""
    total = sum(n for _, n in members)
    if total == 0:
        return None
    averaged = []
    with torch.no_grad():
        for j, s in enumerate(start):
            acc: torch.Tensor | None = None
            for params, n in members:
                term = (s - params[j]) * n
                acc = term if acc is None else acc.add_(term)
            assert acc is not None
            averaged.append(acc.div_(total))
    return averaged


def eager_gradient(
    previous: Sequence[torch.Tensor] | None,
    fresh: Sequence[torch.Tensor],
    own_previous: Sequence[torch.Tensor] | None,
) -> list[torch.Tensor]:
    """One member's outer gradient of an eagerly overlapped round: the previous round's average
    (`previous`, None before the first), plus `fresh` (the member's own fresh share: its samples
    / the round's samples x its pseudo-gradient; the last round: the whole average), minus the
    member's own share of the previous round (`own_previous`, None before its first):
    `prev_avg + (share - prev_share)`, so the others' fresh shares arrive one round late. The
    swarm's replicas (`stage_server.replica.eager_round`) take it with this very function."""
    grads = []
    with torch.no_grad():
        for j, f in enumerate(fresh):
            g = f.clone() if previous is None else previous[j] + f
            if own_previous is not None:
                g.sub_(own_previous[j])
            grads.append(g)
    return grads


def ordered_sum(parts: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """The sum of `parts` per tensor, ((p0 + p1) + p2) + ..., in their order: the bits the
    swarm's averaging gives (`stage_server.averaging.owner` sums in the group's order)."""
    total = [t.clone() for t in parts[0]]
    with torch.no_grad():
        for part in parts[1:]:
            for acc, t in zip(total, part, strict=True):
                acc.add_(t)
    return total


def eager_gradients(
    previous: Sequence[torch.Tensor] | None,
    shares: Sequence[Sequence[torch.Tensor]],
    own_previous: Sequence[Sequence[torch.Tensor] | None],
    complete: bool = False,
) -> list[list[torch.Tensor]]:
    """Every member's `eager_gradient` (`shares[m]` its fresh share, `own_previous[m]` its
    last); `complete`: the last round, whose average is waited for: every member adds the
    others' fresh shares too (the round's whole sum, `ordered_sum` of `shares`)."""
    whole = ordered_sum(shares) if complete else None
    return [
        eager_gradient(previous, share if whole is None else whole, before)
        for share, before in zip(shares, own_previous, strict=True)
    ]
