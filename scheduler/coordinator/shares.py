"""Fair shares of a step among the trainers asking for work."""

from __future__ import annotations

import time
from collections import OrderedDict

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
        # trainer -> its last lease call, oldest first: the silent ones leave from the front
        self._heard: OrderedDict[str, float] = OrderedDict()
        # any trainer's last lease call (none yet: the start), on the clock and on the wall
        self._last, self._last_wall = clock.now(), time.time()

    def heard(self, trainer: str) -> None:
        self._heard[trainer] = self._last = self.clock.now()
        self._last_wall = time.time()
        self._heard.move_to_end(trainer)

    def silent_since(self) -> float | None:
        """Since when (unix seconds) no trainer has asked for work (the start, where none ever
        has), once that is longer than `horizon_s`, so longer than any lease a trainer might
        still be working under; else None. A job without a trainer waits for one: this says
        so. A time, not a duration: the words made of it stay the same while it lasts."""
        silent = self.clock.now() - self._last > self.horizon_s
        return self._last_wall if silent else None

    def share(self, ledger: StepLedger, trainer: str, available: int) -> int:
        """Costs no scan of the trainers or the step: the ledger keeps who holds leases. Every
        trainer holding one was heard within `horizon_s` (its lease runs out no later), so the
        waiting ones are those heard less those holding."""
        horizon = self.clock.now() - self.horizon_s
        while self._heard and next(iter(self._heard.values())) < horizon:
            self._heard.popitem(last=False)
        held = ledger.held_by(trainer)
        others = len(self._heard) - (trainer in self._heard)
        waiting = max(0, others - (ledger.holding() - (1 if held else 0)))
        if not waiting:
            return available
        return max(0 if held else 1, -(-(available + held) // (1 + waiting)) - held)
