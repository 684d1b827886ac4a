"""What a forward saved for its backward, in bytes: the distinct storages its saved tensors hold
(`Footprint`, fed by the activation cache's `saved_tensors_hooks`), or on a device whose allocator
keeps a count, what the forward left allocated there (`DeviceFootprint`).

On CUDA no Python runs per saved tensor (a stage call saves hundreds; a hook each is host time
the GPU waits for): the footprint is what the forward left allocated on the device, the CUDA
allocator's count after it less before it (saved tensors, casts and output, each storage once,
as the hooks count them), plus its input. Another thread allocating on the device meanwhile (a
delayed update's averaging) moves the figure by what it holds at the end: the bound is then
approximate, never a correctness matter (an eviction costs a recomputation).
"""

from __future__ import annotations

import torch

from swarm.device.sharing import DeviceMemory, TorchDeviceMemory

__all__ = ["DeviceFootprint", "Footprint", "measured_on_device"]


class Footprint:
    """The bytes of the distinct storages a forward saved for its backward (`counting`)."""

    def __init__(self) -> None:
        self._storages: dict[int, int] = {}  # data pointer -> bytes

    def add_input(self, t: torch.Tensor) -> None:
        self.add(t)

    def add_output(self, t: torch.Tensor) -> None:
        self.add(t)

    def add(self, t: torch.Tensor) -> None:
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return  # the stage's own (or a view of it: `w.t()`), held whether or not cached
        storage = t.untyped_storage()
        self._storages[storage.data_ptr()] = storage.nbytes()

    @property
    def nbytes(self) -> int:
        return sum(self._storages.values())


class DeviceFootprint:
    """The bytes a forward on a device left allocated there (`counting`), with its input's: the
    allocator's count (`memory.allocated`) after the forward less before it."""

    def __init__(self, device: torch.device, memory: DeviceMemory | None = None) -> None:
        self.device = device
        self._memory = memory or TorchDeviceMemory()
        self._start = self._allocated()
        self._left = 0
        self._input = 0

    def _allocated(self) -> int:
        return self._memory.allocated(self.device) or 0

    def close(self) -> None:
        self._left = max(0, self._allocated() - self._start)

    def add_input(self, t: torch.Tensor) -> None:
        self._input = t.untyped_storage().nbytes()  # allocated before: not in the difference

    def add_output(self, t: torch.Tensor) -> None:
        """Allocated by the forward: counted already."""

    @property
    def nbytes(self) -> int:
        return self._left + self._input


def measured_on_device(device: torch.device, memory: DeviceMemory | None = None) -> bool:
    """Whether a forward on `device` is counted by its allocator (CUDA's, or a stand-in's) rather
    than by hooks on each saved tensor (elsewhere: no allocator statistics to read)."""
    return (memory or TorchDeviceMemory()).allocated(device) is not None
