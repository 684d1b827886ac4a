"""Work on a thread that stays its caller's until it ends (`on_thread`): a lossy body's widening
(`swarm.wire.chunking.decode_named_async`, `decode_async`), whose memory the caller's receive
budget holds while it lasts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TypeVar

__all__ = ["on_thread"]

T = TypeVar("T")


async def on_thread(work: Callable[[], T]) -> T:
    """`work()` on a thread, its caller's until it ends: a caller cancelled meanwhile is
    cancelled once the thread is done. A thread cannot be stopped, and what it widens is
    reserved in the caller's receive budget until the caller returns; returning at once left
    the widening outside the budget. The wait is one decode's, bounded by the caller's
    `max_bytes` (about 0.1 s for 4M values of hadamard3, the costliest codec)."""
    running = asyncio.ensure_future(asyncio.to_thread(work))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        if running.done():
            raise
    while not running.done():  # cancelled while the thread works: however often, wait it out
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({running})
    if not running.cancelled():
        running.exception()  # looked at: the caller is cancelled, not failed
    raise asyncio.CancelledError
