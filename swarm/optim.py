"""The optimizer of a job, built the same way by the reference and by every stage replica, so that
the same gradients give bitwise the same update everywhere."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from swarm.config import OptimizerConfig

__all__ = ["build_optimizer"]


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig
) -> torch.optim.Optimizer:
    # foreach=False: the multi-tensor kernels group parameters differently from the per-tensor
    # path; one code path everywhere keeps replicas and the reference in agreement.
    if cfg.kind == "adamw":
        return torch.optim.AdamW(
            params,
            lr=cfg.lr,
            betas=(cfg.betas[0], cfg.betas[1]),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            foreach=False,
        )
    return torch.optim.SGD(
        params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, foreach=False
    )
