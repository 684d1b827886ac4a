"""The update of a job, built and applied the same way by the reference and by every stage replica,
so that the same gradients give bitwise the same update everywhere: the optimizer, the learning
rate of each step (a pure function of the step) and the global-norm clipping coefficient."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from swarm.errors import NonFiniteGradient
from swarm.job.config import JobConfig, OptimizerConfig
from swarm.job.rule import rule_of
from swarm.model.flat import flat_view

__all__ = [
    "NORM_PIECE",
    "NORM_ROWS",
    "build_optimizer",
    "clip_scale",
    "computes_on",
    "grad_sq_norm",
    "is_boundary",
    "lr_at",
    "scale_grads",
    "update",
]

# As `torch.nn.utils.clip_grad_norm_`: keeps the coefficient finite for a zero gradient.
_CLIP_EPS = 1e-6


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig, *, fused: bool | None = None
) -> torch.optim.Optimizer:
    """The job's optimizer over `params`. On a CPU the per-tensor path (foreach=False): the
    multi-tensor kernels group parameters differently, and one code path keeps CPU replicas and
    the reference bitwise in agreement. On CUDA, AdamW runs fused (one kernel for all of a
    stage's parameters, not a dozen launches per tensor): every CUDA replica of a stage runs the
    same kernel, so they agree bitwise with each other, and with the CPU reference to float32
    rounding (the device check compares them: bench/gpu_check.sh). `fused` None: as the device
    says; True: fused wherever torch has the kernel (a CPU too: the stand-in of a CUDA stage's
    update, which a CPU test runs).

    The fused kernel writes the parameters through their pointers, and autograd's version
    counters do not move: what is keyed on them (bf16 copies, `swarm.model.low_copies`; casts
    made once a step, `swarm.model.cast_once`) would keep the weights of before the update. So
    each step of a fused AdamW moves them itself (`_moved`), wherever it is called from."""
    params = list(params)
    if fused is None:
        fused = _all_cuda(params)
    if cfg.kind == "adamw":
        optimizer = torch.optim.AdamW(
            params,
            lr=cfg.lr,
            betas=(cfg.betas[0], cfg.betas[1]),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            foreach=False,
            fused=fused or None,
        )
        if fused:
            optimizer.register_step_post_hook(_moved)
        return optimizer
    return torch.optim.SGD(
        params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, foreach=False
    )


def _moved(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After a fused step: each parameter's version moves, as an in-place op's would."""
    torch.autograd.graph.increment_version(
        [p for group in optimizer.param_groups for p in group["params"]]
    )


def _all_cuda(params: Sequence[torch.Tensor]) -> bool:
    """Whether fused AdamW takes `params`: all floating-point, all on CUDA devices."""
    return bool(params) and all(p.is_cuda and p.is_floating_point() for p in params)


def lr_at(cfg: OptimizerConfig, step: int, steps: int) -> float:
    """The learning rate of optimizer step `step` (0-based) of a job of `steps` steps: a linear
    rise over `warmup_steps` (step 0 already moves, at lr / warmup_steps), then `schedule` from
    `lr` down to `min_lr` at the last step. A rollback or a join recomputes it from the step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    done = min(1.0, (step - cfg.warmup_steps) / max(1, steps - 1 - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * done
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * done))


def computes_on(job: JobConfig, step: int) -> int:
    """How many updates the parameters step `step` computes on have had. Synchronous: all of
    steps 0..step-1. With `training.delayed_update`: all but the last (step t's gradient is
    taken at the parameters before step t-1's update, so that update and its averaging overlap
    step t's microbatches); steps 0 and 1 both compute on the initial parameters. The final
    evaluation, after the last step, is of the trained parameters either way."""
    return rule_of(job).computes_on(step, job.training.steps)


def is_boundary(job: JobConfig, step: int) -> bool:
    """Where `has_rounds`: whether a round ends before step `step` (after `step` local
    updates): every `round_steps` steps, and after the job's last step."""
    return rule_of(job).is_boundary(step, job.training.steps)


# Elements of a gradient squared into one partial sum. The float64 squares the norm makes are
# NORM_ROWS pieces at a time: 128 MiB at most, not the whole gradient's size again in float64
# (0.6 GiB for a 41M-element matrix), and a few kernels a chunk rather than a few a piece (a
# 243M-parameter stage took ~1,300 launches piece by piece, ~45 this way).
NORM_PIECE = 1 << 20
NORM_ROWS = 16


def grad_sq_norm(grads: Iterable[torch.Tensor]) -> float:
    """The squared L2 norm of a stage's gradient in float64, whatever the training dtype, as
    every replica and the reference compute it: over the tensors laid end to end in parameter
    order (a view when they already are, as a replica's sums and the reference's gradients are;
    else one copy), each NORM_PIECE consecutive elements' squares summed, and those partial sums
    summed. A function of the values alone, not of how they are cut into tensors. Read once at
    the end: on a GPU one synchronization."""
    tensors = [g.detach() for g in grads]
    if not tensors or sum(t.numel() for t in tensors) == 0:
        return 0.0
    flat = flat_view(tensors)
    if flat is None:
        flat = torch.cat([t.reshape(-1) for t in tensors])
    partial: list[torch.Tensor] = []
    chunk = NORM_PIECE * NORM_ROWS
    for start in range(0, flat.numel(), chunk):
        part = flat[start : start + chunk]
        whole = part.numel() - part.numel() % NORM_PIECE
        if whole:
            rows = _float64_copy(part[:whole].view(-1, NORM_PIECE))
            partial.append(rows.square_().sum(dim=1))
        if whole < part.numel():
            partial.append(_float64_copy(part[whole:]).square_().sum().reshape(1))
    return float(torch.cat(partial).sum())


def _float64_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` in float64, always a copy (squared in place next: a float64 gradient's own
    `.double()` is itself)."""
    return t.to(torch.float64, copy=True)


def scale_grads(grads: Sequence[torch.Tensor], divisor: float, scale: float = 1.0) -> None:
    """`grads` divided by `divisor`, then (when not 1) multiplied by `scale`, in place: the step's
    mean and its clipping, the same two roundings of each element wherever it is done, in one
    kernel each over the flat tensor when the gradients lie end to end (else one a tensor)."""
    if not grads:
        return
    flat = flat_view(grads)
    for g in [flat] if flat is not None else grads:
        if divisor != 1.0:  # x / 1 is x: no kernel for it
            g.div_(divisor)
        if scale != 1.0:
            g.mul_(scale)


def clip_scale(stage_sq_norms: Sequence[float], max_norm: float) -> float:
    """What every stage multiplies its averaged gradient by so that the whole model's gradient
    norm is at most `max_norm` (1.0 without clipping, or when it is small enough). The stages'
    squared norms are summed in stage order. A NaN or infinite one raises `NonFiniteGradient`,
    clipping or not: no coefficient makes that gradient finite (NaN gave 1.0, inf 0.0)."""
    bad = [k for k, sq in enumerate(stage_sq_norms) if not math.isfinite(sq)]
    if bad:
        raise NonFiniteGradient(
            "; ".join(f"stage {k} gradient's squared norm is {stage_sq_norms[k]}" for k in bad)
            + ": not finite, so no update is made from it"
        )
    if max_norm <= 0:
        return 1.0
    norm = math.sqrt(math.fsum(stage_sq_norms))
    return min(1.0, max_norm / (norm + _CLIP_EPS))


def update(optimizer: torch.optim.Optimizer, job: JobConfig, step: int, scale: float = 1.0) -> None:
    """Optimizer step `step` on gradients already in `.grad` (the step's mean): clipped by
    `scale`, at the step's learning rate; then the gradients are dropped."""
    lr = lr_at(job.optimizer, step, job.training.steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
        if scale != 1.0:
            scale_grads([p.grad for p in group["params"] if p.grad is not None], 1.0, scale)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
