"""`swarm local`: the job trained in one process with gradient accumulation over the same
microbatches. It is the correctness reference for the swarm and its performance baseline."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from swarm.config import JobConfig
from swarm.data import VAL_STEP, DataSource, make_data, make_val_data
from swarm.model import StageModule, build_model, layer_costs, loss_sum, partition, precision
from swarm.optim import build_optimizer, clip_scale, grad_sq_norm, update
from swarm.progress import StepRecord

__all__ = ["evaluate", "train_local"]


def train_local(
    job: JobConfig,
    device: torch.device | str = "cpu",
    steps: int | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
) -> StageModule:
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
    for step in range(total):
        start, total_loss, samples = time.perf_counter(), 0.0, 0
        val_loss = evaluate(job, model, val, device) if val and step % every == 0 else None
        for index in range(m):
            inputs, targets = (t.to(device) for t in data.microbatch(step, index))
            with precision(job, device):
                loss = loss_sum(model(inputs), targets)
            loss.backward()  # .grad accumulates the sum over microbatches
            total_loss += float(loss.detach())
            samples += int(inputs.shape[0])
        for p in model.parameters():
            assert p.grad is not None
            p.grad.div_(samples)
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


def evaluate(
    job: JobConfig, model: StageModule, val: DataSource, device: torch.device | str
) -> float:
    """The validation loss of `model`: forward only over the fixed validation microbatches,
    summed in their order and divided by their samples, as the step ledger does."""
    losses = []
    with torch.no_grad():
        for i in range(job.training.eval_microbatches):
            inputs, targets = (t.to(device) for t in val.microbatch(VAL_STEP, i))
            with precision(job, device):
                losses.append((float(loss_sum(model(inputs), targets)), int(inputs.shape[0])))
    return sum(loss for loss, _ in losses) / sum(n for _, n in losses)
