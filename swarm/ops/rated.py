"""Rated log lines: what a stranger can make happen many times a second (a refused connection, a
refused call, a malformed packet) is logged at most once per `every_s` for each key, and the next
line that does get through says how many were held back, so an attacker cannot fill the disk or
bury the lines an operator needs. Counting every refusal is the metrics' job, not the log's."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable

__all__ = ["RatedLog"]

_MAX_KEYS = 1024  # distinct keys remembered; past it the oldest are forgotten (memory bounded)


class RatedLog:
    """`warning(key, msg, *args)` logs on `log` when `key` was last logged `every_s` or more ago;
    otherwise counts the line as held back. `key` is what makes two lines the same kind (the
    refusal's reason, not the caller's address, which a stranger can vary)."""

    def __init__(
        self,
        log: logging.Logger,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log, self._every_s, self._clock = log, every_s, clock
        self._last: dict[Hashable, float] = {}
        self._held: dict[Hashable, int] = {}

    def warning(self, key: Hashable, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args)

    def info(self, key: Hashable, msg: str, *args: object) -> bool:
        return self.log(logging.INFO, key, msg, *args)

    def log(self, level: int, key: Hashable, msg: str, *args: object) -> bool:
        """True when the line was written, False when it was held back."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._every_s:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        held = self._held.pop(key, 0)
        self._last.pop(key, None)  # re-inserted last: the dict stays oldest-first
        self._last[key] = now
        while len(self._last) > _MAX_KEYS:
            oldest = next(iter(self._last))
            del self._last[oldest]
            self._held.pop(oldest, None)
        if held:
            msg = f"{msg} (and {held} more like it in the last {self._every_s:g} s)"
        self._log.log(level, msg, *args)
        return True
