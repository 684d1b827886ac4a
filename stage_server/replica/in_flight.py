"""The accumulating calls a replica has taken and not yet ended, for Info: a push (or a relay
plane's Backward) whose gradient may still land in this replica's sums, with the run it would be
held under.

The coordinator's late-receipt check reads them (`scheduler.coordinator.late_receipts`): a
microbatch given back while its push is still being computed here (an overloaded replica's,
whose caller's deadline passed) is not leased again until that push ends, so its receipt is
adopted instead of landing after the replay went out under a new run, where it would void this
replica.

An entry is held from the moment the call's backward here is asked for (at a stage before the
last, once the stages after it have answered: the deepest stage names the push until then)
until its compute on the worker has ended, receipt recorded, and not only while its handler
waits: a caller that hangs up cancels the handler, but a compute already running on the worker
runs to its end and accumulates all the same. One whose compute never started (still queued
when its caller hung up: the worker drops it) leaves with its handler. The worker thread and the
event loop both touch the entries: under a lock. (One gap is left: a call the worker has marked
running, whose caller hangs up in the microseconds before its compute marks the entry started,
is unnamed until it does.)

Info reads the entries before the receipts, and an entry leaves only after its receipt is
recorded: a push that ends between the two reads is named twice (in flight and received), never
missed."""

from __future__ import annotations

import threading
from collections import Counter

__all__ = ["InFlight", "PushesInFlight"]

Key = tuple[int, int, int]  # (step, index, run)


class PushesInFlight:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: Counter[Key] = Counter()

    def enter(self, step: int, index: int, run: int) -> InFlight:
        """A call that accumulates microbatch `index` of `step` under `run` is admitted."""
        entry = InFlight(self, (step, index, run))
        self._add(entry.key)
        return entry

    def listed(self) -> list[Key]:
        """(step, index, run) of every call in flight, once each, in order."""
        with self._lock:
            return sorted(self._held)

    def _add(self, key: Key) -> None:
        with self._lock:
            self._held[key] += 1

    def _remove(self, key: Key) -> None:
        with self._lock:
            self._held[key] -= 1
            if self._held[key] <= 0:
                del self._held[key]


class InFlight:
    """One call's entry: `started` as its compute begins on the worker, `ended` once it has (or
    `abandoned` by its handler, which ends it only where its compute never started)."""

    def __init__(self, registry: PushesInFlight, key: Key) -> None:
        self.registry, self.key = registry, key
        self._lock = threading.Lock()
        self._started, self._held = False, True  # held from `enter`

    def started(self) -> None:
        """On the worker, as the compute begins: held again where its handler gave up first (the
        worker had taken it already; it accumulates all the same)."""
        with self._lock:
            self._started = True
            if not self._held:
                self._held = True
                self.registry._add(self.key)

    def ended(self) -> None:
        """On the worker, once the compute has ended (its receipt recorded, or failed)."""
        with self._lock:
            if self._held:
                self._held = False
                self.registry._remove(self.key)

    def abandoned(self) -> None:
        """The handler ended without the compute's result (its caller hung up, or it failed):
        the entry leaves unless the compute is running, which ends it itself."""
        with self._lock:
            if self._held and not self._started:
                self._held = False
                self.registry._remove(self.key)
