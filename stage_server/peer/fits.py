"""What a peer can hold: its device's memory, and each stage's footprint on it, checked before a
stage is built.

Before it builds anything, a peer counts each stage's footprint on the meta device (its state,
its activations at the cache's bound, the averaging's buffers: `swarm.model.footprint`) and
refuses a job with a stage its free memory cannot hold (`check_fits`): an allocation the kernel
cannot back kills the peer (the OOM killer), it raises nothing, and on a GPU shared with other
processes, or holding a stage already, the total is not there to take. The replica's
speed measurement (`stage_server.replica.speed`) and a move (`stage_server.peer.moving`) ask here
first."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from stage_server.peer.limits import PeerLimits
from swarm.device.facts import DeviceFacts, TorchFacts, free_memory
from swarm.errors import ResourceExhausted
from swarm.job.config import JobConfig
from swarm.model.footprint import StageFootprint, stage_footprints
from swarm.model.sizes import format_bytes, layer_parameters

__all__ = ["check_fits", "device_memory", "footprints"]


def _machine_memory() -> int:
    """The machine's memory (bytes), or its cgroup's limit when lower; 0 when unknown."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        total = 0
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        limit = "max"
    if limit.isdigit() and (not total or int(limit) < total):
        return int(limit)
    return max(total, 0)


def device_memory(device: torch.device | str) -> int:
    """Bytes of memory `device` has for a stage: a GPU's total, the machine's for the CPU (and
    MPS, which shares it); 0 when unknown. What a peer announces, and checks a job against."""
    try:
        device = torch.device(device)
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
    except (RuntimeError, AssertionError, ValueError):
        return 0
    return _machine_memory()


def footprints(job: JobConfig, limits: PeerLimits | None = None) -> list[StageFootprint]:
    """Each stage of `job`'s footprint on a peer of `limits` (default: the defaults): the job's
    activation cache and chunks within the peer's bounds, as `stage_server.replica.messages` clamps
    them when the stage is served."""
    peer = limits or PeerLimits()
    rt = job.runtime
    return stage_footprints(
        job,
        activation_cache=min(rt.activation_cache, peer.max_activation_cache),
        activation_cache_bytes=peer.max_activation_cache_bytes,
        chunk_bytes=min(max(rt.chunk_bytes, peer.min_chunk_bytes), peer.max_chunk_bytes),
    )


def check_fits(
    job: JobConfig,
    device: torch.device,
    memory_bytes: int | None = None,
    *,
    limits: PeerLimits | None = None,
    facts: DeviceFacts | None = None,
) -> None:
    """ResourceExhausted when a stage of `job` at its footprint (state, activations at the
    cache's bound, averaging buffers: `footprints`) cannot fit `memory_bytes`, by default the
    device's free memory now (`swarm.device.facts.free_memory`, within its total: what other
    processes and this one hold is not there to take), counted on the meta device, before
    anything is allocated. A layer is first built in float64 on the CPU
    (`swarm.model.transformer`): its largest must fit the machine too."""
    if memory_bytes is None:
        facts = facts or TorchFacts()
        try:
            free, how = free_memory(device, facts)
        except (RuntimeError, AssertionError):  # a device torch cannot ask: its total bounds
            free, how = None, ""
        total = facts.free_total(device.index or 0)[1] if free and device.type == "cuda" else 0
        total = total or device_memory(device)
        if free:  # within the total: a container's limit is below the host's free memory
            memory = min(free, total) if total else free
            said = f"{format_bytes(memory)} {how}" + (f" of {format_bytes(total)}" if total else "")
        else:
            memory, said = total, f"{format_bytes(total)} in all"
    else:
        memory, said = memory_bytes, format_bytes(memory_bytes)
    if memory > 0:
        each = footprints(job, limits)
        over = [k for k, footprint in enumerate(each) if footprint.total > memory]
        if over:
            stage = over[0]
            raise ResourceExhausted(
                f"stage {stage} of job {job.name!r} needs {each[stage]} at least, more than "
                f"this peer's {said} on {device}: not measured (nothing allocated)"
            )
    machine = _machine_memory()
    layer = max(layer_parameters(job)) * 8
    if machine > 0 and layer > machine:
        raise ResourceExhausted(
            f"a layer of job {job.name!r} is {format_bytes(layer)} in float64, as it is built, "
            f"more than this machine's {format_bytes(machine)}: not measured (nothing allocated)"
        )
