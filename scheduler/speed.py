"""A job's training speed as `swarm status` shows it: samples per second over a recent window,
so it falls to zero when training stalls (the last step's own figure would stay up forever), and
over the whole run once the job has ended."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable

__all__ = ["RecentSpeed"]


class RecentSpeed:
    """Samples committed in the last `window_s` seconds, per second. Before a window has passed
    since the first step, the rate is over the time since the attempt started (`start`), not the
    whole window, so a new job's speed is right from its first steps."""

    def __init__(self, clock: Callable[[], float], window_s: float = 30.0) -> None:
        self.clock, self.window_s = clock, window_s
        self._commits: deque[tuple[float, int]] = deque()  # (when, samples), oldest first
        self._since: float | None = None  # when the current attempt started counting
        self._last: float | None = None  # when the last step committed
        self._step_s: float | None = None

    def start(self) -> None:
        """Training (re)starts now: the time before is not counted as stalled."""
        self._since = self.clock()

    def committed(self, samples: int) -> None:
        now = self.clock()
        if self._since is None:
            self._since = now
        self._commits.append((now, samples))
        self._trim(now)
        self._last = now
        times = [t for t, _ in self._commits]
        gaps = sorted(b - a for a, b in itertools.pairwise(times))
        if gaps:
            self._step_s = gaps[len(gaps) // 2]

    @property
    def last_at(self) -> float | None:
        """When the last step committed (or training started, if later), None before either."""
        return max((t for t in (self._last, self._since) if t is not None), default=None)

    @property
    def step_s(self) -> float | None:
        """The median time between commits in the window as of the last commit; None before two
        commits in a window."""
        return self._step_s

    def rate(self) -> float:
        now = self.clock()
        self._trim(now)
        if self._since is None or not self._commits:
            return 0.0
        elapsed = min(self.window_s, now - self._since)
        if elapsed <= 0.0:
            return 0.0
        return sum(samples for _, samples in self._commits) / elapsed

    def _trim(self, now: float) -> None:
        while self._commits and self._commits[0][0] <= now - self.window_s:
            self._commits.popleft()
