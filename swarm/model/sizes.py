"""What one stage of a job holds in memory, known before any of it is allocated: its parameters
counted on the meta device, and the bytes of the state a replica keeps for them.

The scheduler refuses at submit a job whose largest stage no peer could hold, and a peer refuses
to measure one it could not (`stage_server.peer.fits`): a job of 3.3 T parameters must be a clear
refusal, not peers killed by the kernel's OOM killer one layer at a time. Every block of a model
has the same shape, so an embedding, one block and a head, built on the meta device (no memory,
no time however wide), count every layer.
"""

from __future__ import annotations

from dataclasses import replace

from swarm.job.config import JobConfig
from swarm.model.bottleneck import half_parameters
from swarm.model.transformer import DTYPES, layer_costs, partition, stage_layout

__all__ = ["format_bytes", "layer_parameters", "stage_parameters", "stage_state_bytes"]


def layer_parameters(job: JobConfig) -> list[int]:
    """Parameters of each layer of `job`'s model: embedding, `n_layers` blocks, head (without a
    learned bottleneck's halves: `stage_parameters` adds them at the cuts)."""
    # One stage has no boundary to narrow: counted as the plain model (a subspace's basis and
    # table are buffers, no parameters).
    model = replace(job.model, n_layers=1, boundary_rank=0, boundary_bottleneck=0)
    training = replace(job.training, stages=1)
    one = replace(job, model=model, training=training)
    counts = {0: 0, 1: 0, 2: 0}
    for name, p in stage_layout(one, 0).named_parameters():
        counts[int(name.split(".")[1])] += p.numel()  # "layers.<i>.…"
    return [counts[0], *[counts[1]] * job.model.n_layers, counts[2]]


def stage_parameters(job: JobConfig) -> list[int]:
    """Parameters of each stage of `job`, as its layers are partitioned."""
    per_layer = layer_parameters(job)
    ranges = partition(layer_costs(job.model), job.training.stages)
    counts = [sum(per_layer[i] for i in r) for r in ranges]
    if job.model.boundary_bottleneck:  # a squeeze ends every stage but the last, an expand
        squeeze, expand = half_parameters(job.model.d_model, job.model.boundary_bottleneck)
        last = len(counts) - 1  # starts every stage but the first
        counts = [n + squeeze * (k < last) + expand * (k > 0) for k, n in enumerate(counts)]
    return counts


def _copies(job: JobConfig) -> int:
    """Copies of its parameters a replica holds at least: the weights and the gradient sums,
    and the optimizer's state (AdamW's two moments, SGD's momentum)."""
    opt = job.optimizer
    return 2 + (2 if opt.kind == "adamw" else 1 if opt.momentum else 0)


def stage_state_bytes(job: JobConfig) -> list[int]:
    """The bytes of each stage's state a replica holds at least (weights, gradient sums and the
    optimizer's state in the job's dtype; activations come on top)."""
    width = DTYPES[job.training.dtype].itemsize
    return [n * width * _copies(job) for n in stage_parameters(job)]


def format_bytes(n: int) -> str:
    """`n` bytes for people: "1.5 GiB", "103 TiB"."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            break
        value /= 1024
    return f"{value:.0f} {unit}" if unit == "B" or value >= 100 else f"{value:.1f} {unit}"
