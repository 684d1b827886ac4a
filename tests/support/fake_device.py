"""A fake device for unit tests of device<->host staging (`stage_server.averaging.staging`): it
counts the bytes each copy moves, treating every tensor (CPU ones, in a test) as a device's."""

from __future__ import annotations

import torch

__all__ = ["CountingCopies"]


class CountingCopies:
    """`DeviceCopies` over CPU tensors taken for a device's: each copy's bytes are counted, and
    the largest one."""

    def __init__(self) -> None:
        self.to_host_bytes = self.to_device_bytes = self.largest = 0

    def on_device(self, t: torch.Tensor) -> bool:
        return True

    def to_host(self, src: torch.Tensor, into: torch.Tensor) -> None:
        into.copy_(src)
        self.to_host_bytes += src.nbytes
        self.largest = max(self.largest, src.nbytes)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
        self.to_device_bytes += src.nbytes
        self.largest = max(self.largest, src.nbytes)
