"""A stand-in for an asynchronous device (CUDA), behind
`swarm.device.compute_clock.ComputeClock`: a computation's call returns at once and its work
finishes `seconds` later, as a CUDA kernel launch returns before the GPU has run it."""

from __future__ import annotations

import time

__all__ = ["FakeAsyncDevice"]


class FakeAsyncDevice:
    """Each computation timed on it (a `now()`, the call, then `settle()`) leaves `seconds` of
    device work still running when its call returns; `settle` waits that out. A timer that stops
    its clock when the call returns sees the launch; one that settles first sees at least
    `seconds`."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.settled = 0  # how many times a timer waited for the device

    def now(self) -> float:
        return time.perf_counter()

    def settle(self) -> None:
        time.sleep(self.seconds)  # the work queued by the call that just returned
        self.settled += 1
