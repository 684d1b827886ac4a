"""CPU stand-ins for a GPU's parts, so the logic a GPU runs runs on a CPU, in tests and in CPU
passes that stand for a device.

Its memory (`StandInMemory`): the same `DeviceMemory` a CUDA device answers through, over numbers
the caller sets: a window sized with the other servers on the card and checked against free
memory before each entry, a forward's footprint counted by the allocator, not by hooks. Its
compiler (`traced`): a stage's forward captured into a graph by torch's own tracer, guards and
recompilation on a new shape included, run by eager kernels in place of inductor's generated ones
(which need a C++ toolchain on a CPU and would only be slower to build).

`StandInMemory` is one device: `total` bytes, of which tensors hold `allocated` (the allocator's
count, which a forward's `DeviceFootprint` reads before and after) and something else on the
device holds `used_elsewhere` (the other servers' weights, another process). Free is what is
left. Several stand-ins with one `name` are one device to the claim registry. With `counts`
off it keeps no allocator count, as a device whose forwards the hooks count.
"""

from __future__ import annotations

import torch
from torch import nn

from swarm.device.compiled import Run

__all__ = ["StandInMemory", "traced"]


def traced(module: nn.Module) -> Run:
    """`module` compiled as `swarm.device.compiled.inductor` does it, its graph run eagerly."""
    return torch.compile(module, backend="eager", dynamic=False)  # type: ignore[return-value]


class StandInMemory:
    """`DeviceMemory` of a device that is only numbers (above)."""

    def __init__(
        self,
        total: int,
        *,
        name: str = "standin-0",
        used_elsewhere: int = 0,
        counts: bool = True,
    ) -> None:
        self.total, self.name = total, name
        self.used_elsewhere = used_elsewhere
        self.counts = counts  # False: no allocator count, so a forward is counted by hooks
        self.allocated_bytes = 0  # the allocator's count: what tensors hold on the device
        self.reads = 0  # times free memory was read: each entry kept reads it again

    def allocate(self, nbytes: int) -> None:
        """Tensors of `nbytes` made on the device (negative: freed)."""
        self.allocated_bytes = max(0, self.allocated_bytes + nbytes)

    def free_and_total(self, device: torch.device) -> tuple[int, int] | None:
        self.reads += 1
        free = self.total - self.used_elsewhere - self.allocated_bytes
        return max(0, free), self.total

    def identity(self, device: torch.device) -> str:
        return self.name

    def allocated(self, device: torch.device) -> int | None:
        return self.allocated_bytes if self.counts else None
