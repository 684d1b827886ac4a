"""The one clock: seconds on a monotonic scale behind a `Protocol`, so the policies, the ledger and
the peer registry run on real time in the service, on injected time in tests and the simulator."""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "FakeClock", "MonotonicClock"]


class Clock(Protocol):
    """Seconds on a monotonic scale; only differences matter."""

    def now(self) -> float: ...


class MonotonicClock:
    """The real clock."""

    def now(self) -> float:
        return time.monotonic()


class FakeClock:
    """A clock that moves only when told to (unit tests)."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds
