"""Taking an assigned stage: where a move builds the new stage, and what the peer lets go first.

A move (a serving peer assigned another stage) builds the new stage while the old one still
holds its memory, then swaps them, so the old stage serves until the new one is ready. On a
device that cannot hold both, that build runs out of memory (on a GPU), or the kernel's OOM
killer ends the peer (on the CPU). So before a move the peer counts both stages' footprints
(`swarm.model.footprint`) against its free memory (`swarm.device.facts.free_memory`): when the
new stage does not fit beside the old one, the old one is released first (its calls are then
NOT_FOUND, and the trainers replay them on its other replicas, as for any peer that leaves),
its memory given back, and then the new one is built.

Nothing is lost by releasing first: the scheduler moves only a spare replica (a stage keeps
`min_replicas` others, `scheduler.rebalance_loop`), the peer announced itself DRAINING before
(the scheduler and its coordinator stop sending it the old stage's work), and a stage's state
lives in its other replicas and the checkpoint, not in this copy alone.

Also here: what `SWARM_STAGE_THROTTLE` slows, and how a log line names a stage's layers.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch

from stage_server.peer.fits import footprints
from stage_server.peer.limits import PeerLimits
from swarm.device.facts import DeviceFacts, free_memory
from swarm.job.config import JobConfig
from swarm.model.sizes import format_bytes
from swarm.model.transformer import layer_costs, partition

__all__ = [
    "STAGE_THROTTLE_ENV",
    "MovePlan",
    "describe_layers",
    "plan_move",
    "return_memory",
    "stage_slowdown",
]

# A test and demo hook: "K:F,..." makes this peer F times slower while it serves stage K only,
# a slowdown its join-time measurement cannot see (so only live measurements reveal it).
STAGE_THROTTLE_ENV = "SWARM_STAGE_THROTTLE"


def stage_slowdown(stage: int) -> float:
    for item in filter(None, os.environ.get(STAGE_THROTTLE_ENV, "").split(",")):
        k, _, factor = item.partition(":")
        if int(k) == stage:
            return max(1.0, float(factor))
    return 1.0


@dataclass(frozen=True)
class MovePlan:
    """Whether the new stage is built beside the old one, and why (a log line's words)."""

    beside: bool
    why: str


def plan_move(
    old: tuple[JobConfig, int],
    new: tuple[JobConfig, int],
    device: torch.device,
    limits: PeerLimits,
    facts: DeviceFacts,
) -> MovePlan:
    """Whether stage `new` (a job and its stage) fits beside stage `old`, which this peer
    serves, in `device`'s free memory. The old stage's state is allocated already (not in the
    free memory); its activations and averaging buffers may grow to their bounds while the new
    one builds, and the new one needs its whole footprint. Pure computation on the meta device:
    call it off the event loop. Free memory unknown: beside, as before there was a count."""
    try:
        free, how = free_memory(device, facts)
    except (RuntimeError, AssertionError):  # a device torch cannot ask: as before, beside
        free, how = None, ""
    was = footprints(old[0], limits)[old[1]]
    will = footprints(new[0], limits)[new[1]]
    need = will.total + was.activations + was.averaging
    if free is None:
        return MovePlan(True, "free memory unknown")
    said = (
        f"stage {new[1]} needs {will}; beside stage {old[1]} "
        f"({format_bytes(was.activations + was.averaging)} more at its bounds) that is "
        f"{format_bytes(need)}, against {format_bytes(free)} {how} on {device}"
    )
    return MovePlan(need <= free, said)


def return_memory(device: torch.device) -> None:
    """Give a released stage's memory back before another is built: its tensors go with their
    last references (a graph's reference cycles hold activations until collected), and on CUDA
    the allocator's cache returns them to the device (mem_get_info counts what it caches as
    used). Called off the event loop, after the servicer let the stage go."""
    gc.collect()
    if device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def describe_layers(config: JobConfig, stage: int) -> str:
    """The model layers stage `stage` of `config` holds, as a log line names them."""
    costs = layer_costs(config.model)
    layers = partition(costs, config.training.stages)[stage]
    if not layers:
        return f"none of {len(costs)} layers"
    held = f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}..{layers[-1]}"
    return f"{held} of {len(costs)}"
