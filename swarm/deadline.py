"""`within`: await something for at most so many seconds, and never lose a cancellation.

It stands in for `asyncio.wait_for` everywhere in the service. Python 3.11's `wait_for` (the
version the service runs on) returns the awaited result instead of raising `CancelledError`
when the cancellation arrives after the awaited thing finished but before `wait_for` resumed: a
loop around it then never ends, and neither does the task group waiting for it (a job's
`Assignments.grow` did exactly that, and a scheduler's job never ended, one test run in 20).
`asyncio.timeout` cancels the waiting task itself and has no such window (3.12 rebuilt
`wait_for` on it); `tests/test_deadline.py` keeps `wait_for` out of the service's code.

`cancel_kept` guards the awaits of a library that waits with `wait_for` inside (aiomqtt's
publish, subscribe and connect): a scheduler's job task cancelled as its publish was confirmed
went on placing for a minute.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

__all__ = ["cancel_kept", "cancelled_since", "cancels", "settled", "within"]

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout_s: float | None) -> T:
    """`await awaitable`, raising `TimeoutError` after `timeout_s` seconds (`None`: no bound;
    zero or less: only what completes without waiting). Awaited in the calling task: a
    cancellation of the caller cancels it, and is never swallowed."""
    async with asyncio.timeout(timeout_s):
        return await awaitable


async def cancel_kept(awaitable: Awaitable[T]) -> T:
    """`await awaitable`, and raise `CancelledError` if the calling task was cancelled meanwhile
    and `awaitable` returned or failed anyway (a `wait_for` inside it swallowed the
    cancellation).

    Only a cancellation that arrived during this await counts (the task's `cancelling()` count
    grew): a task that handled one before and now cleans up (a job saying it ended) goes on.
    An enclosing `asyncio.timeout` still turns its own cancellation into `TimeoutError`."""
    before = cancels()
    try:
        result = await awaitable
    except Exception as error:  # `wait_for` returns a failure it awaited just the same
        if cancelled_since(before):
            raise asyncio.CancelledError from error
        raise
    if cancelled_since(before):
        raise asyncio.CancelledError
    return result


def cancels() -> int:
    """How many cancellations of the calling task are under way (`Task.cancelling()`; none
    outside a task): taken before an await, for `cancelled_since` after it."""
    task = asyncio.current_task()
    return task.cancelling() if task is not None else 0


def cancelled_since(before: int) -> bool:
    """Whether the calling task was cancelled since `cancels()` said `before`: a cancellation
    it had already handled (a cleanup under way) is not a new one."""
    return cancels() > before


async def settled(*futures: asyncio.Future[Any]) -> None:
    """Wait until every one of `futures` is done, even when cancelled meanwhile (the
    cancellation is raised after); their results and exceptions are left to their owners. For
    work that reads or writes what its caller lets go as it returns (a thread's write, a
    digest of a push's tensors): a plain wait cancelled would let go of it under the work."""
    cancelled = False
    while not all(f.done() for f in futures):
        try:
            await asyncio.wait(futures)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
