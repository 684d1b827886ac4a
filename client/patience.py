"""A bound on a standalone trainer's retries (DESIGN.md, "Failures say why"): with no committed
step for the job's `runtime.patience_s`, it stops, naming the last failure its trainers saw. A
remote trainer (`swarm trainer --scheduler`) is bound alike by its own failures: every
microbatch of its failing for `patience_s` (the job may go on with its other trainers).

Why: a microbatch whose hop finds no replica is handed back and leased again, and the wiring
retries a replica after its backoff; each retry is bounded, but the loop of them is not. A stage
that refuses every call (a handover check that refuses every push, say) would keep a trainer
retrying, and its GPUs idle, forever. The scheduler's own jobs are bounded by its stall watch
instead (`scheduler.stalls`): they wait, saying why, since the cause may clear."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import NoReturn

from swarm.errors import SwarmError

__all__ = ["NoProgress", "Patience", "bounded"]


class NoProgress(SwarmError):
    """No step committed for the job's patience: the text names the last failure."""


class Patience:
    """`watch` raises `NoProgress` once `patience_s` pass with no `committed` call; `cause()`:
    the last failure (None: none failed), `where()`: the open step's progress, in words."""

    def __init__(
        self,
        patience_s: float,
        cause: Callable[[], str | None],
        where: Callable[[], str] = lambda: "",
        clock: Callable[[], float] = time.monotonic,
        waited: str = "no step committed",
    ) -> None:
        """`waited`: what did not happen for `patience_s`, in words."""
        self.patience_s, self.cause, self.where, self.clock = patience_s, cause, where, clock
        self.waited = waited
        self._last = clock()

    def committed(self) -> None:
        """A step committed: the patience starts again."""
        self._last = self.clock()

    async def watch(self) -> NoReturn:
        while True:
            left = self._last + self.patience_s - self.clock()
            if left <= 0:
                raise NoProgress(self.text())
            await asyncio.sleep(min(left, 1.0))

    def text(self) -> str:
        cause = self.cause()
        why = f"the last failure: {cause}" if cause else "no call failed (the stages are slow?)"
        where = self.where()
        return f"{self.waited} for {self.patience_s:g} s (runtime.patience_s); {why}" + (
            f"; {where}" if where else ""
        )


async def bounded(work: Awaitable[object], patience: Patience) -> None:
    """`work`, unless `patience` runs out first: then it is cancelled and `NoProgress` raised,
    naming the last failure."""
    done, watch = asyncio.ensure_future(work), asyncio.ensure_future(patience.watch())
    try:
        await asyncio.wait([done, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:  # cancelled too, or one of them ended: the other goes
        for task in (done, watch):
            task.cancel()
        await asyncio.gather(done, watch, return_exceptions=True)
    if watch.done() and not watch.cancelled():
        watch.result()  # NoProgress: the work was cancelled for it
    done.result()
