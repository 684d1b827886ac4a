"""How fast one submitter may submit: a token bucket per submitter (`--max-submits-per-minute`;
its burst a minute's worth, or `--max-jobs-per-submitter` if more). The cap on unfinished jobs
(`scheduler.admission`) does not bound this: a loop of submit and cancel keeps none unfinished,
yet each submit costs a meta-device build of the model, a stored spec and a retained
announcement."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from scheduler.callers import shown
from swarm.errors import ConfigError, ResourceExhausted

__all__ = ["MAX_SUBMITS_PER_MINUTE", "SubmitRate"]

MAX_SUBMITS_PER_MINUTE = 30.0

_MAX_SUBMITTERS = 4096  # buckets remembered; past it the full ones are forgotten (memory bound)


class SubmitRate:
    """`take(submitter)`: one submit of `submitter`, or ResourceExhausted saying when it may
    retry. Each submitter has `burst` submits saved up at most, and gets `per_minute` back a
    minute."""

    def __init__(
        self, per_minute: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not (per_minute > 0 and math.isfinite(per_minute)):
            raise ConfigError(
                f"--max-submits-per-minute {per_minute:g} is not allowed; use a number > 0 "
                "(0 on the command line: no bound)"
            )
        if burst < 1:
            raise ConfigError(f"a submit burst of {burst}: use an integer >= 1")
        self.per_minute, self.burst, self._clock = per_minute, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # submitter -> (tokens, when)

    def _tokens(self, submitter: str, now: float) -> float:
        tokens, when = self._buckets.get(submitter, (float(self.burst), now))
        return min(float(self.burst), tokens + (now - when) * self.per_minute / 60.0)

    def take(self, submitter: str) -> None:
        now = self._clock()
        tokens = self._tokens(submitter, now)
        if tokens < 1.0:
            wait_s = math.ceil((1.0 - tokens) * 60.0 / self.per_minute)
            raise ResourceExhausted(
                f"{shown(submitter)} submits too fast: at most {self.per_minute:g} jobs a "
                f"minute, {self.burst} at once (--max-submits-per-minute {self.per_minute:g}): "
                f"retry in {wait_s} s"
            )
        self._buckets[submitter] = (tokens - 1.0, now)
        if len(self._buckets) > _MAX_SUBMITTERS:
            full = [s for s in self._buckets if self._tokens(s, now) >= self.burst]
            for s in full:
                del self._buckets[s]
