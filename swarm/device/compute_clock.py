"""How long a computation took: until the device finished it, not until its launch returned.

On CUDA a forward or backward returns once its kernels are queued; the device runs them after.
Timed by the calling thread's clock alone, a stage's compute would look as long as its launch,
and only a stage that reads a result back (the last, through its loss) would show its real
cost: live speeds, rebalancing, `--throttle`, the queue depth and `queued_seconds` would all
point at the wrong stage. So every timing of compute goes through a `ComputeClock`: read `now()`,
run the computation, `settle()` (wait until the work launched so far on this thread's stream
has finished), read `now()` again.

`settle` waits on an event recorded on the current stream, not on the whole device: copies that
run on other streams (averaging, state transfer) are not this computation's time. On the host
the computation has finished when its call returns, so settling is free.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

__all__ = ["HOST_CLOCK", "ComputeClock", "CudaClock", "HostClock", "clock_for"]


class ComputeClock(Protocol):
    """The clock compute is timed by, on the thread that launches it."""

    def now(self) -> float:
        """Seconds on a monotonic clock (queue waits are differences of these too)."""
        ...

    def settle(self) -> None:
        """Return once the work this thread launched on the device so far has finished."""
        ...


class HostClock:
    """The CPU: a call's work is done when it returns."""

    def now(self) -> float:
        return time.perf_counter()

    def settle(self) -> None:
        pass


HOST_CLOCK = HostClock()


class CudaClock:
    """A CUDA device: settling waits on an event recorded behind the launched work."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def now(self) -> float:
        return time.perf_counter()

    def settle(self) -> None:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        done.synchronize()  # blocks this thread only, until the stream reaches the event


class AcceleratorClock:
    """Another accelerator (MPS, XPU, ...): settling waits for the whole device, the one wait
    `torch.accelerator` offers for every kind."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def now(self) -> float:
        return time.perf_counter()

    def settle(self) -> None:
        torch.accelerator.synchronize(self.device)


def clock_for(device: torch.device | str) -> ComputeClock:
    """The clock for compute on `device`."""
    device = torch.device(device)
    if device.type == "cpu" or device.type == "meta":
        return HOST_CLOCK
    if device.type == "cuda":
        return CudaClock(device)
    return AcceleratorClock(device)
