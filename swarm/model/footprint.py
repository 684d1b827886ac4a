"""What one stage of a job takes of a peer's memory while it serves, known before any of it is
allocated: its state (`swarm.model.sizes`), the activations its cache keeps at its bound, and
the averaging's chunk-sized buffers. A peer checks a job's largest stage against its free
memory before it measures (`stage_server.peer.fits.check_fits`), and a move checks whether the
new stage fits beside the old one (`stage_server.peer.moving`).

One microbatch's activations are counted as the activation cache counts them
(`stage_server.replica.activation_cache`): the storages its forward saves for the backward, the
stage's own parameters left out, plus its input and output; here on the meta device, one layer of
each kind (an embedding, a block, a head: every block of a model has one shape), so a stage of any
width costs no memory and little time. Under bf16-mixed autocast the forward saves bfloat16
activations and a bfloat16 cast of each weight per microbatch; the count here is in the job's
dtype plus those casts, an upper estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from swarm.job.config import JobConfig
from swarm.model.sizes import format_bytes, layer_parameters, stage_state_bytes
from swarm.model.transformer import DTYPES, layer_costs, loss_sum, partition, stage_layout

__all__ = ["AVERAGING_BUFFERS", "StageFootprint", "layer_activation_bytes", "stage_footprints"]

# Chunk-sized buffers a round holds on the device at once: the chunk it receives and the one
# it sends (the rest of the round works in place on the gradient sums, counted in the state).
AVERAGING_BUFFERS = 2


@dataclass(frozen=True)
class StageFootprint:
    """The bytes a stage takes on a peer: `state` (weights, gradient sums, optimizer state, and
    a subspace boundary's basis and table), `activations` (what its cache keeps at its bound,
    and the microbatch being computed), `averaging` (the round's chunk buffers)."""

    state: int
    activations: int
    averaging: int

    @property
    def total(self) -> int:
        return self.state + self.activations + self.averaging

    def __str__(self) -> str:
        return (
            f"{format_bytes(self.total)} ({format_bytes(self.state)} of state, "
            f"{format_bytes(self.activations)} of activations at the cache's bound, "
            f"{format_bytes(self.averaging)} of averaging buffers)"
        )


def layer_activation_bytes(job: JobConfig) -> tuple[int, int, int]:
    """Bytes one microbatch's forward saves for its backward in an embedding, a block and a
    head of `job`'s model (with its loss), its parameters left out, counted on the meta
    device."""
    # One stage has no boundary to narrow: the layers' own (a small boundary's are on top).
    model = replace(job.model, n_layers=1, boundary_rank=0, boundary_bottleneck=0)
    one = replace(job, model=model, training=replace(job.training, stages=1))
    module = stage_layout(one, 0)
    b, t = job.training.microbatch_size, job.model.seq_len
    x: torch.Tensor = torch.zeros(b, t, dtype=torch.long, device="meta")
    counted: list[int] = []
    for i, layer in enumerate(module.layers.values()):
        saved: dict[int, int] = {}  # storage -> bytes: a storage saved twice counts once

        def pack(t: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
            if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
                return t  # held anyway, cached or not
            storage = t.untyped_storage()
            saved[storage._cdata] = storage.nbytes()  # meta storages have no data pointer
            # detached: a tensor saved by the node that made it would hold that node, which
            # holds it, a cycle gc cannot see (`stage_server.replica.activation_cache.counting`)
            return t.detach()

        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            x = layer(x)
            if i == 2:  # the head: its loss saves the logits' softmax too
                loss_sum(x, torch.zeros(b, t, dtype=torch.long, device="meta"))
        counted.append(sum(saved.values()))
    return counted[0], counted[1], counted[2]


def stage_footprints(
    job: JobConfig, *, activation_cache: int, activation_cache_bytes: int, chunk_bytes: int
) -> list[StageFootprint]:
    """Each stage's footprint on a peer that keeps at most `activation_cache` microbatches'
    activations and `activation_cache_bytes` of them, and averages in `chunk_bytes` chunks
    (the peer's bounds, with the job's within them: `stage_server.peer.fits.footprints`)."""
    embedding, block, head = layer_activation_bytes(job)
    params = layer_parameters(job)
    width = DTYPES[job.training.dtype].itemsize
    b, t, d = job.training.microbatch_size, job.model.seq_len, job.model.d_model
    edge = b * t * d * width  # a stage's input (or output) between stages
    stages = job.training.stages
    m = job.model  # a subspace boundary's basis and fixed table: every stage holds both
    rows = m.vocab_size + (m.seq_len if m.kind == "gpt" else 0) + m.boundary_rank
    fixed = rows * d * width if m.boundary_rank else 0
    result = []
    for k, (layers, state) in enumerate(
        zip(partition(layer_costs(job.model), stages), stage_state_bytes(job), strict=True)
    ):
        last = job.model.n_layers + 1
        saved = sum(embedding if i == 0 else head if i == last else block for i in layers)
        if job.training.precision == "bf16-mixed":  # weight casts (once a step: an upper bound)
            saved += 2 * sum(params[i] for i in layers)
        one = saved + (edge if k > 0 else b * t * 8) + edge  # its input and output too
        # The last stage keeps nothing (its ForwardBackward is one call): one microbatch at a
        # time. The others keep what fits both bounds (a microbatch over the byte bound is not
        # kept), and compute one more beside them.
        kept = 0 if k == stages - 1 else min(activation_cache, activation_cache_bytes // one)
        result.append(
            StageFootprint(state + fixed, (kept + 1) * one, AVERAGING_BUFFERS * chunk_bytes)
        )
    return result
