"""How fast new peers enter a job's pools (issue 64, item 3). With the shared token ids are free:
a liar banned from a job comes back under a fresh id, and each ban costs the job a rollback of
up to its doubt window (`scheduler.coordinator.trust.bans`). So a peer the job has never had as a
member starts joining a stage only within that stage's entry rate: `ENTRY_BURST` at once, then
one more each `ENTRY_EVERY_S` (a token bucket per stage). A liar cycling ids thus costs the job
at most `ENTRY_BURST + 3600 / ENTRY_EVERY_S` bans a stage an hour, each rolling back no further
than the steps since that id entered (its `first_seen`) and, at most, its doubt window.

Not new, and never held back: a peer the job knows (`known`: a member before, by the job
store's record across restarts), one moved from another stage, one re-admitted after an
outage, and one that already passed (its join retried). Honest growth is a few machines a stage
at a time: 8 at once and 4 a minute more take a job's scale-up as it comes (the replicas
present at a job's start are members without joining: `coordinator.reconcile`); a larger wave
joins over minutes, in order of arrival at the step boundaries, each held one said in `swarm
status` (`waits`) and the log. What a token holder can still do with it: spend a stage's
entries with fresh ids, delaying (never refusing) honest newcomers there."""

from __future__ import annotations

import logging
from collections.abc import Callable

from swarm.clock import Clock
from swarm.ops.rated import RatedLog

__all__ = ["ENTRY_BURST", "ENTRY_EVERY_S", "Entry"]

log = logging.getLogger(__name__)

ENTRY_BURST = 8  # new peers a stage takes at once
ENTRY_EVERY_S = 15.0  # then one more each this many seconds: 4 a minute
LOG_EVERY_S = 10.0  # a stage's held peers said at most once per this (the next says how many)


class Entry:
    def __init__(
        self,
        clock: Clock,
        known: Callable[[str], bool],
        burst: int = ENTRY_BURST,
        every_s: float = ENTRY_EVERY_S,
    ) -> None:
        """`known(peer)`: the job has had `peer` as a member (it enters freely)."""
        self.clock, self.known, self.burst, self.every_s = clock, known, burst, every_s
        self._buckets: dict[int, tuple[float, float]] = {}  # stage -> (entries left, when)
        self._passed: set[str] = set()  # new peers let in, not known as members yet
        self.held: dict[str, int] = {}  # peer -> the stage it waits to enter
        self._rated = RatedLog(log, every_s=LOG_EVERY_S, clock=clock.now)

    def admits(self, stage: int, peer: str) -> bool:
        """Whether `peer` may start joining `stage` now: one entry of the stage's is spent on a
        new peer, once."""
        if self.known(peer):
            self._passed.discard(peer)
            self.held.pop(peer, None)
            return True
        if peer in self._passed:
            return True
        left = self._left(stage)
        if left < 1.0:
            if peer not in self.held:  # once a peer, and rated: new ids are free
                self._rated.warning(
                    ("entry", stage),
                    "stage %d: %s waits its turn to join: %s",
                    stage,
                    peer,
                    self.why(stage),
                )
            self.held[peer] = stage
            return False
        self._buckets[stage] = (left - 1.0, self.clock.now())
        self._passed.add(peer)
        self.held.pop(peer, None)
        return True

    def forget(self, current: set[str]) -> None:
        """Only `current` peers wait to enter: the others left."""
        self.held = {p: k for p, k in self.held.items() if p in current}
        self._passed &= current

    def why(self, stage: int) -> str:
        """Why a new peer waits to enter `stage`, in words."""
        wait = max(0.0, (1.0 - self._left(stage)) * self.every_s)
        return (
            f"new peers enter a stage at most {self.burst} at once, then one each "
            f"{self.every_s:.0f} s (the next in {wait:.0f} s)"
        )

    def _left(self, stage: int) -> float:
        """The entries `stage` has left now (refilled since it last spent one)."""
        now = self.clock.now()
        left, when = self._buckets.get(stage, (float(self.burst), now))
        left = min(float(self.burst), left + (now - when) / self.every_s)
        self._buckets[stage] = (left, now)
        return left
