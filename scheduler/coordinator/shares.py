"""Fair shares of a step among the trainers asking for work."""

from __future__ import annotations

from scheduler.coordinator.ledger import StepLedger
from swarm.clock import Clock

__all__ = ["Shares"]


class Shares:
    """Of the tasks free now, the most a trainer gets: an equal share (what it holds already
    included) with the other trainers heard from within `horizon_s` that hold no work. So the
    trainer that asks first and again at once (the scheduler's embedded one, in-process, before a
    remote long poll can wake) does not take a whole step while others wait. A trainer silent
    for `horizon_s` (the lease timeout) stops counting."""

    def __init__(self, clock: Clock, horizon_s: float) -> None:
        self.clock, self.horizon_s = clock, horizon_s
        self._heard: dict[str, float] = {}  # trainer -> its last lease call

    def heard(self, trainer: str) -> None:
        self._heard[trainer] = self.clock.now()

    def share(self, ledger: StepLedger, trainer: str, available: int) -> int:
        horizon = self.clock.now() - self.horizon_s
        for gone in [t for t, when in self._heard.items() if when < horizon]:
            del self._heard[gone]
        leased = ledger.leased()
        waiting = sum(1 for t in self._heard if t != trainer and not leased[t])
        if not waiting:
            return available
        held = leased[trainer]
        return max(0 if held else 1, -(-(available + held) // (1 + waiting)) - held)
