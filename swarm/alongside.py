"""`alongside`: run helper tasks beside a wait, and lose neither a helper's error nor a
cancellation of the caller.

Python 3.11's `asyncio.TaskGroup` ranks its children's errors above its parent's own
cancellation: a parent cancelled while the group winds down after a child failed (the other
children finishing their cleanups) gets the child's error, its `cancelling()` count left raised
and nothing to raise it again. A scheduler's job task that lost a user's cancel so took the
helper's error for a peer gone, and placed and trained the job again.

Here no child's error reaches the group: the first is kept, the helpers are cancelled, and it is
raised once they have all ended. A cancellation of the caller meanwhile finds a group without
errors, and the group raises it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine
from typing import Any

__all__ = ["alongside"]

log = logging.getLogger(__name__)


async def alongside(
    until: Awaitable[Any],
    helpers: list[Coroutine[Any, Any, Any]],
    to_the_end: list[Coroutine[Any, Any, Any]] | None = None,
) -> None:
    """Run `helpers` until `until` completes, then cancel them, and wait for them and for the
    `to_the_end` ones (run beside them, never cancelled for `until`) to end. The first of
    either to fail (an `Exception`) ends it early, everything cancelled, and is raised after all
    have ended; one that returns early is let go. A cancellation of the caller cancels them all
    and is raised, whatever they raise on the way out."""
    failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()  # its first error

    async def kept(work: Coroutine[Any, Any, Any]) -> None:
        try:
            await work
        except Exception as error:
            if not failed.done():
                failed.set_result(error)

    ended = asyncio.ensure_future(until)
    try:
        async with asyncio.TaskGroup() as group:
            stopped = [group.create_task(kept(helper)) for helper in helpers]
            rest = [group.create_task(kept(work)) for work in to_the_end or []]
            await asyncio.wait([ended, failed], return_when=asyncio.FIRST_COMPLETED)
            for task in stopped:
                task.cancel()
            while not failed.done() and (running := [t for t in rest if not t.done()]):
                await asyncio.wait([failed, *running], return_when=asyncio.FIRST_COMPLETED)
            if failed.done():
                for task in rest:
                    task.cancel()
    except asyncio.CancelledError:
        if failed.done():  # said, since what is raised is the cancellation
            log.warning("cancelled while winding down after an error: %s", failed.result())
        _say_unraised(ended)
        raise
    finally:
        ended.cancel()
    if failed.done():
        _say_unraised(ended)
        raise failed.result()
    ended.result()  # its own error, if it ended with one


def _say_unraised(ended: asyncio.Future[Any]) -> None:
    """`until`'s own error where another is raised (a helper's, or the cancellation): said,
    and taken out of the task (asyncio's "exception was never retrieved", at some collection
    later, told neither when nor what it came beside)."""
    if ended.done() and not ended.cancelled() and (error := ended.exception()) is not None:
        log.warning("its wait failed too, as it wound down: %s: %s", type(error).__name__, error)
