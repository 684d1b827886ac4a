"""Fake devices for unit tests of device<->host staging (`stage_server.averaging.staging`), each
treating every tensor (CPU ones, in a test) as a device's: `CountingCopies` counts the bytes each
copy moves; `GatedCopies` makes a copy as slow as a busy GPU's, until the test lets it finish.
`WatchedCopies` are torch's real ones (a CUDA test's), noting the thread and current device of
each. `copy_started` waits, off nothing but the event loop, until a slow copy has begun."""

from __future__ import annotations

import asyncio
import threading
from typing import Protocol

import torch

from stage_server.averaging.staging import TorchChunkCopies

__all__ = ["CountingCopies", "GatedCopies", "WatchedCopies", "copy_started"]


class _Slow(Protocol):
    @property
    def started(self) -> threading.Event: ...


async def copy_started(slow: _Slow) -> None:
    """Until `slow`'s copy has begun (`GatedCopies`, `tests.support.slow_copies.SlowCopies`;
    polled: the loop must be free to notice, or it is not)."""
    while not slow.started.is_set():
        await asyncio.sleep(0.005)


class CountingCopies:
    """`ChunkCopies` over CPU tensors taken for a device's: each copy's bytes are counted, and
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


class GatedCopies(CountingCopies):
    """`CountingCopies` whose first copy of kind `slow` ("to_host" or "to_device") blocks its
    caller until `gate` is set or `seconds` pass; `started` is set when it begins. `opened`
    says whether the gate let it through (False: it timed out, as it must when it holds the
    thread that would open the gate: the event loop's); `ended` is set once its bytes landed.
    `threads`: the thread of every copy."""

    def __init__(self, slow: str = "to_host", seconds: float = 5.0) -> None:
        super().__init__()
        if slow not in ("to_host", "to_device"):
            raise ValueError(f"slow must be to_host or to_device, got {slow!r}")
        self.slow, self.seconds = slow, seconds
        self.started, self.gate = threading.Event(), threading.Event()
        self.opened: bool | None = None  # None: the slow copy has not ended (or not begun)
        self.ended = threading.Event()  # the slow copy's bytes have landed
        self.threads: set[str] = set()

    def _wait(self, kind: str) -> bool:
        """Whether this is the slow copy (waited for the gate)."""
        self.threads.add(threading.current_thread().name)
        if kind != self.slow or self.started.is_set():
            return False
        self.started.set()
        self.opened = self.gate.wait(self.seconds)
        return True

    def to_host(self, src: torch.Tensor, into: torch.Tensor) -> None:
        slow = self._wait("to_host")
        super().to_host(src, into)
        if slow:
            self.ended.set()

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        slow = self._wait("to_device")
        super().to_device(dst, src)
        if slow:
            self.ended.set()


class WatchedCopies(TorchChunkCopies):
    """Torch's own copies, each noting its thread (`threads`) and that thread's current CUDA
    device (`devices`, its index)."""

    def __init__(self) -> None:
        self.threads: set[str] = set()
        self.devices: set[int] = set()

    def _seen(self) -> None:
        self.threads.add(threading.current_thread().name)
        self.devices.add(torch.cuda.current_device())

    def to_host(self, src: torch.Tensor, into: torch.Tensor) -> None:
        self._seen()
        super().to_host(src, into)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._seen()
        super().to_device(dst, src)
