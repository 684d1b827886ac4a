"""What a handover (`swarm.device.handover`) gives the process that made it: bytes offered to a
co-located process, or a slot for its answer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from swarm.proto import tensor_pb2

__all__ = ["Offer"]


@dataclass
class Offer:
    """A payload handed over, or a slot for one: its `handle` for the other process, what this
    process reads of it, and how it lets it go."""

    handle: tensor_pb2.Handover
    nbytes: int
    read: Callable[[], torch.Tensor]  # the bytes as they are now: a uint8 tensor of this side's
    release: Callable[[], None]  # idempotent
    # Before `release`, when its owner knows no receiver mapped it (the call went elsewhere, was
    # refused, or was turned away busy): CUDA IPC keeps a shared allocation, once its maker
    # frees it, until the one receiver each share counts on let go; this gives that count back,
    # so the allocation is freed, not kept in torch's "limbo" for ever. Nothing elsewhere.
    unused: Callable[[], None] = lambda: None
