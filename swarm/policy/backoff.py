"""The one retry pause: capped exponential backoff with jitter. Every retry loop in swarm waits
with a `Backoff` (one loop) or a `Backoffs` (one pause per key, such as a peer, on a `Clock`)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Hashable
from dataclasses import dataclass, field

from swarm.clock import Clock, MonotonicClock

__all__ = ["Backoff", "Backoffs"]


@dataclass
class Backoff:
    """Pauses of `first_s`, `first_s * factor`, ... capped at `cap_s`, each scaled by a random
    factor in `[1 - jitter, 1 + jitter]` so that peers retrying together spread out."""

    first_s: float
    cap_s: float
    factor: float = 2.0
    jitter: float = 0.2
    rng: random.Random = field(default_factory=random.Random, repr=False)
    attempts: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.cap_s or self.factor < 1 or not 0 <= self.jitter < 1:
            raise ValueError(f"bad backoff {self!r}")

    def peek(self) -> float:
        """The next pause without jitter."""
        try:
            return min(self.cap_s, self.first_s * self.factor**self.attempts)
        except OverflowError:  # a loop failing for hours (2.0**1024): long at its cap
            return self.cap_s

    def next(self) -> float:
        """The next pause, jittered; counts an attempt."""
        delay = self.peek() * self.rng.uniform(1 - self.jitter, 1 + self.jitter)
        self.attempts += 1
        return delay

    async def sleep(self) -> None:
        await asyncio.sleep(self.next())

    def reset(self) -> None:
        self.attempts = 0


class Backoffs:
    """One `Backoff` per key with the time its pause ends: `ready(key)` until `failed(key)` says
    otherwise; `succeeded(key)` forgets the key, so the table holds only keys still failing."""

    def __init__(
        self, first_s: float, cap_s: float, clock: Clock | None = None, jitter: float = 0.2
    ) -> None:
        self.first_s, self.cap_s, self.jitter = first_s, cap_s, jitter
        self.clock = clock or MonotonicClock()
        self._until: dict[Hashable, tuple[float, Backoff]] = {}

    def ready(self, key: Hashable) -> bool:
        entry = self._until.get(key)
        return entry is None or self.clock.now() >= entry[0]

    def failed(self, key: Hashable) -> float:
        """Start or lengthen `key`'s pause; returns its length."""
        _, backoff = self._until.get(key) or (
            0.0,
            Backoff(self.first_s, self.cap_s, jitter=self.jitter),
        )
        delay = backoff.next()
        self._until[key] = (self.clock.now() + delay, backoff)
        return delay

    def succeeded(self, key: Hashable) -> None:
        self._until.pop(key, None)

    def forget(self, keep: set[Hashable]) -> None:
        """Drop every key not in `keep` (peers that left), so the table cannot grow forever."""
        for key in [k for k in self._until if k not in keep]:
            del self._until[key]

    def __len__(self) -> int:
        return len(self._until)
