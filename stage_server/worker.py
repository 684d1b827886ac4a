"""A replica's worker: the one thread its torch work runs on, how many calls wait for it, and how
long one takes.

Torch work is serial per replica: one thread, so a stage's parameters, gradient sums and caches are
never touched by two calls at once (`StageRuntime` takes no locks), and the event loop stays free
to move the bytes of the calls queued behind it. The calls queued or running here are the load
the peer reports (`waiting`); `ema_seconds` is the service time its load reports divide by, the
time a call holds the worker and never its wait in the queue (`run_queued` returns that wait
separately, so a trainer's estimate of this replica is its speed, not its backlog).

`throttle` > 1 stands in for a slower device: the worker is held that much longer after each call,
as a slower device would hold it, and the EMA sees the held time.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

__all__ = ["LOAD_EMA", "Worker"]

T = TypeVar("T")
LOAD_EMA = 0.2  # weight of the newest call in the reported moving average


class Worker:
    """Runs calls on `executor` (a single-thread pool); `on_queue(+1/-1)` sees each call enter and
    leave (the stage's queue-depth metric)."""

    def __init__(
        self, executor: Executor, on_queue: Callable[[int], None], throttle: float = 1.0
    ) -> None:
        self.executor, self._on_queue = executor, on_queue
        self.throttle = throttle  # >1: each call holds the worker that many times as long
        self.waiting = 0  # calls queued or running: the load this peer reports
        self.ema_seconds: float | None = None  # moving average of one call (seconds)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the worker thread."""
        result, _ = await self.run_queued(fn, *args, **kwargs)
        return result

    async def run_queued(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, float]:
        """`run`, also returning how long the call waited for the worker (seconds)."""
        self._on_queue(1)
        self.waiting += 1
        submitted = time.perf_counter()
        started: list[float] = []

        def timed() -> T:
            started.append(time.perf_counter())
            return self._throttled(functools.partial(fn, *args, **kwargs))

        try:
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(self.executor, timed)
            return result, started[0] - submitted
        finally:
            self._on_queue(-1)
            self.waiting -= 1

    def _throttled(self, call: Callable[[], T]) -> T:
        start = time.perf_counter()
        try:
            return call()
        finally:
            if self.throttle > 1:  # hold the worker, as a slower device would be held
                time.sleep((self.throttle - 1) * (time.perf_counter() - start))
            seconds = time.perf_counter() - start
            self.ema_seconds = (
                seconds
                if self.ema_seconds is None
                else (LOAD_EMA * seconds + (1 - LOAD_EMA) * self.ema_seconds)
            )
