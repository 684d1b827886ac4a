"""`swarm local`: the job trained in one process with gradient accumulation over the same
microbatches. It is the correctness reference for the swarm and its performance baseline."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from swarm.config import JobConfig
from swarm.data import make_data
from swarm.model import StageModule, build_model, layer_costs, loss_sum, partition, precision
from swarm.optim import build_optimizer, clip_scale, grad_sq_norm, update
from swarm.progress import StepRecord

__all__ = ["train_local"]


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
    for step in range(steps if steps is not None else job.training.steps):
        start, total_loss, samples = time.perf_counter(), 0.0, 0
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
            on_step(StepRecord(step, total_loss / samples, samples, seconds, tokens, norm))
    return model
