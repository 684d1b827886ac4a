"""Work on a thread that stays its caller's until it ends (`on_thread`): a lossy body's widening
(`swarm.wire.chunking.decode_named_async`, `decode_async`), whose memory the caller's receive
budget holds while it lasts."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar, cast

__all__ = ["on_thread"]

T = TypeVar("T")


class _Start:
    """Whether a thread's work began, or its caller gave it up before it did: one or the other,
    decided under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.began = self.abandoned = False

    def begin(self) -> bool:
        """On the thread: True when the work may run (its caller still waits for it)."""
        with self._lock:
            self.began = not self.abandoned
            return self.began

    def abandon(self) -> bool:
        """On the loop: True when the work will never run (it had not begun)."""
        with self._lock:
            self.abandoned = not self.began
            return self.abandoned


async def on_thread(work: Callable[[], T]) -> T:
    """`work()` on a thread (the loop's default executor), its caller's until it ends: a caller
    cancelled while it runs is cancelled once the thread is done. A thread cannot be stopped,
    and what it widens is reserved in the caller's receive budget until the caller returns;
    returning at once left the widening outside the budget. The wait is one decode's, bounded
    by the caller's `max_bytes` (about 0.1 s for 4M values of hadamard3, the costliest codec).
    Work still queued behind the executor's other threads is given up instead, never run."""
    start = _Start()

    def guarded() -> T | None:
        return work() if start.begin() else None

    running = asyncio.ensure_future(asyncio.to_thread(guarded))
    try:
        return cast(T, await asyncio.shield(running))  # it began: `work`'s own result
    except asyncio.CancelledError as cancelled:
        if running.done() or start.abandon():
            raise
        while not running.done():  # cancelled while the thread works: however often, wait
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({running})
        if not running.cancelled():
            running.exception()  # looked at: the caller is cancelled, not failed
        raise cancelled
