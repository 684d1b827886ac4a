"""The simulator's bookkeeping: per-stage capacity and work, counts, and the windows they close
into (what the numbers mean: `report`)."""

from __future__ import annotations

from collections.abc import Iterable

from scheduler.sim.model import SimPeer
from scheduler.sim.report import Window

__all__ = ["Integral", "Meter"]


class Integral:
    """The integral over time of a piecewise-constant value, taken window by window."""

    __slots__ = ("area", "since", "value")

    def __init__(self, value: float = 0.0, since: float = 0.0) -> None:
        self.value, self.since, self.area = value, since, 0.0

    def set(self, now: float, value: float) -> None:
        self.area += self.value * (now - self.since)
        self.value, self.since = value, now

    def take(self, now: float) -> float:
        """The area since the last `take`, up to `now`."""
        self.set(now, self.value)
        area, self.area = self.area, 0.0
        return area


class Meter:
    def __init__(self, stages: int) -> None:
        self.stages = stages
        self.serving = [0.0] * stages  # samples/s of the replicas computing on each stage now
        self.capacity = [Integral() for _ in range(stages)]  # of `serving`
        self.optimum = Integral()
        self.window_start = 0.0
        self.processed = [0.0] * stages  # samples each stage computed in this window
        self.completed = 0.0  # samples whose last hop finished in this window
        self.counts = {"joins": 0, "departures": 0, "moves": 0}  # in this window
        self.totals = {"joins": 0, "departures": 0, "moves": 0, "failed_hops": 0}
        self.windows: list[Window] = []

    def serve(self, stage: int, delta: float, t: float) -> None:
        """A replica of `delta` samples/s starts (> 0) or stops (< 0) computing on `stage`."""
        self.serving[stage] += delta
        self.capacity[stage].set(t, self.serving[stage])

    def credit(self, stage: int, speed: float, started: float, t: float) -> None:
        """A replica of `speed` samples/s computed on `stage` from `started` to `t`; the part
        before this window was credited when the last one closed."""
        self.processed[stage] += (t - max(started, self.window_start)) * speed

    def count(self, what: str, n: int = 1) -> None:
        if what in self.counts:
            self.counts[what] += n
        self.totals[what] += n

    def close(self, t: float, peers: Iterable[SimPeer], present: int) -> None:
        """End the window at `t`; `peers` are all peers present, of which hops in progress are
        credited with their work so far."""
        start = self.window_start
        length = t - start
        if length <= 0.0:
            return
        for peer in peers:
            task = peer.busy
            if task is not None and task.started < t:
                self.credit(peer.at, peer.speeds[peer.at], task.started, t)
        capacity = [c.take(t) / length for c in self.capacity]
        slowest = min(range(self.stages), key=capacity.__getitem__)
        current = capacity[slowest]
        counts = self.counts
        self.windows.append(
            Window(
                start_s=start,
                end_s=t,
                samples_per_s=self.processed[slowest] / length,
                completed_per_s=self.completed / length,
                optimum=max(self.optimum.take(t) / length, current),
                current=current,
                peers=present,
                joins=counts["joins"],
                departures=counts["departures"],
                moves=counts["moves"],
            )
        )
        self.window_start, self.completed = t, 0.0
        self.processed = [0.0] * self.stages
        self.counts = dict.fromkeys(counts, 0)
