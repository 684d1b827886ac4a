"""`within`: await something for at most so many seconds, and never lose a cancellation.

It stands in for `asyncio.wait_for` everywhere in the service. Python 3.11's `wait_for` (the
version the service runs on) returns the awaited result instead of raising `CancelledError`
when the cancellation arrives after the awaited thing finished but before `wait_for` resumed: a
loop around it then never ends, and neither does the task group waiting for it (a job's
`Assignments.grow` did exactly that, and a scheduler's job never ended, one test run in 20).
`asyncio.timeout` cancels the waiting task itself and has no such window (3.12 rebuilt
`wait_for` on it); `tests/test_deadline.py` keeps `wait_for` out of the service's code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["within"]

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout_s: float | None) -> T:
    """`await awaitable`, raising `TimeoutError` after `timeout_s` seconds (`None`: no bound;
    zero or less: only what completes without waiting). Awaited in the calling task: a
    cancellation of the caller cancels it, and is never swallowed."""
    async with asyncio.timeout(timeout_s):
        return await awaitable
