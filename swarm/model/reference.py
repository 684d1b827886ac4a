"""`swarm local`: the job trained in one process with gradient accumulation over the same
microbatches. It is the correctness reference for the swarm and its performance baseline."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from swarm.device.facts import apply_matmul_precision
from swarm.job.config import JobConfig
from swarm.job.rule import rule_of
from swarm.model.data import VAL_STEP, DataSource, make_data, make_val_data
from swarm.model.flat import flat_copy
from swarm.model.low_copies import LowCopies
from swarm.model.optim import (
    build_optimizer,
    clip_scale,
    computes_on,
    grad_sq_norm,
    scale_grads,
    update,
)
from swarm.model.transformer import (
    StageModule,
    build_model,
    layer_costs,
    loss_sum,
    partition,
    precision,
)
from swarm.ops.progress import StepRecord

__all__ = ["evaluate", "train_local"]


def train_local(
    job: JobConfig,
    device: torch.device | str = "cpu",
    steps: int | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
) -> StageModule:
    apply_matmul_precision(job.training.tf32, device)
    model = build_model(job, device)
    optimizer = build_optimizer(model.parameters(), job.optimizer)
    data = make_data(job)
    m = job.training.microbatches_per_step
    # Each stage's parameters, as its replicas hold them: clipping sums the stages' squared
    # norms in stage order, as the coordinator does.
    stages = [
        [p for i in layers for p in model.layers[str(i)].parameters()]
        for layers in partition(layer_costs(job.model), job.training.stages)
    ]
    total = steps if steps is not None else job.training.steps
    every, val = job.training.eval_every, make_val_data(job) if job.training.eval_every else None
    # `training.delayed_update`: the parameters before the last update, which the step computes
    # on (`computes_on`); the update itself is applied to the newest parameters.
    stale: dict[str, torch.Tensor] | None = None
    low = LowCopies.of(job)  # bf16-mixed: as a replica computes (`swarm.model.low_copies`)
    for step in range(total):
        start, total_loss, samples = time.perf_counter(), 0.0, 0
        weights = stale if computes_on(job, step) < step else None
        val_loss = evaluate(job, model, val, device, weights) if val and step % every == 0 else None
        # Each stage's gradients lie end to end, as a replica's sums do (starting at -0.0,
        # which the first gradient added leaves as that gradient's own bits): its norm and
        # scaling are then a few kernels over one flat tensor, as the replica's are.
        flat_grads(stages if weights is None else [list(weights.values())])
        for index in range(m):
            inputs, targets = (t.to(device) for t in data.microbatch(step, index))
            with precision(job, device):
                loss = loss_sum(_run(model, weights, inputs, low), targets)
            with low.into_grads() if low is not None else contextlib.nullcontext():
                loss.backward()  # .grad accumulates the sum over microbatches
            total_loss += float(loss.detach())
            samples += int(inputs.shape[0])
        for name, p in model.named_parameters():
            if weights is not None:  # the gradient was taken at the stale copy
                p.grad = weights[name].grad
                weights[name].grad = None
            assert p.grad is not None
        for stage in stages:  # the step's mean: a kernel a stage
            scale_grads([p.grad for p in stage if p.grad is not None], samples)
        if rule_of(job).delays:
            named = model.named_parameters()
            stale = {n: p.detach().clone().requires_grad_(True) for n, p in named}
        sq_norms = [grad_sq_norm(p.grad for p in stage if p.grad is not None) for stage in stages]
        update(optimizer, job, step, clip_scale(sq_norms, job.training.grad_clip))
        if on_step:
            seconds, tokens = time.perf_counter() - start, samples * job.model.seq_len
            norm = math.sqrt(math.fsum(sq_norms))
            record = StepRecord(step, total_loss / samples, samples, seconds, tokens, norm)
            on_step(replace(record, val_loss=val_loss))
    if val is not None:  # the final evaluation, of the trained parameters
        start = time.perf_counter()
        val_loss = evaluate(job, model, val, device)
        if on_step:
            on_step(StepRecord(total, math.nan, 0, time.perf_counter() - start, val_loss=val_loss))
    return model


def flat_grads(groups: Sequence[Sequence[torch.Tensor]]) -> None:
    """Give each group's parameters `.grad`s that lie end to end in one tensor of -0.0, which
    backward adds into in place (as a replica's step sums)."""
    for group in groups:
        if group:
            for p, g in zip(group, flat_copy(group, fill=-0.0), strict=True):
                p.grad = g


def _run(
    model: StageModule,
    weights: dict[str, torch.Tensor] | None,
    inputs: torch.Tensor,
    low: LowCopies | None = None,
) -> torch.Tensor:
    """`model` on `inputs`, with `weights` in place of its parameters when given, and with
    `low`'s bfloat16 copies of its Linear weights when given."""
    if low is not None:
        return low.call(model, (inputs,), weights)  # type: ignore[no-any-return]
    if weights is None:
        return model(inputs)  # type: ignore[no-any-return]
    return torch.func.functional_call(model, weights, (inputs,))  # type: ignore[no-any-return]


def evaluate(
    job: JobConfig,
    model: StageModule,
    val: DataSource,
    device: torch.device | str,
    weights: dict[str, torch.Tensor] | None = None,
) -> float:
    """The validation loss of `model` (with `weights` in place of its parameters, if given):
    forward only over the fixed validation microbatches, summed in their order and divided by
    their samples, as the step ledger does."""
    losses = []
    with torch.no_grad():
        for i in range(job.training.eval_microbatches):
            inputs, targets = (t.to(device) for t in val.microbatch(VAL_STEP, i))
            with precision(job, device):
                loss = loss_sum(_run(model, weights, inputs), targets)
                losses.append((float(loss), int(inputs.shape[0])))
    return sum(loss for loss, _ in losses) / sum(n for _, n in losses)
