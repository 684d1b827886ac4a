"""The job a peer takes up (its starting checkpoint fetched, its stages measured), as a task of
its own beside the bus's job messages (`stage_server.agent`).

Run inline in the loop that reads the job messages, a fetch of hours (a fine-tune's checkpoint
over a home link) held every one of them: the peer showed "idle", a cancel of the job waited for
the whole fetch and the measuring after it, and so did every job announced meanwhile. Now the
messages are read as they come: the job's end stops its take-up at once (a fetch's partial file
is kept, the next fetch goes on from it: `swarm.rpc.fetch_file`; a measurement under way ends on
the worker thread, its figures dropped), and the peer shows what it does ("fetching",
"measuring")."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from swarm.deadline import cancelled_since, cancels

__all__ = ["TakeUp"]

log = logging.getLogger(__name__)


class TakeUp:
    """At most one job's take-up under way."""

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None
        # A refused take-up while it turns to the next job (`refused`): no take-up is under way
        # (the next may start), but a stop must still end it, or it starts one after the stop.
        self._tail: asyncio.Task[None] | None = None
        self.job = ""  # the job under way ("": none)
        self.fetching = False  # its starting checkpoint is being fetched (else: measured)

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(
        self,
        job: str,
        work: Coroutine[Any, Any, bool],
        refused: Callable[[], Awaitable[None]],
    ) -> None:
        """Take up `job` with `work` (True: taken up; False: refused, the peer free again, when
        `refused` is awaited: the next job a free peer turns to starts its own take-up)."""
        if self.busy:
            raise RuntimeError(f"job {self.job} is being taken up: one at a time")
        self.job = job
        self._task = asyncio.create_task(self._run(work, refused), name=f"take up job {job}")

    async def _run(
        self, work: Coroutine[Any, Any, bool], refused: Callable[[], Awaitable[None]]
    ) -> None:
        try:
            taken = await work
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: said, and the peer's other work goes on
            log.exception("taking up job %s failed", self.job)
            return
        finally:
            self.fetching = False
        if not taken:
            # over: the job it turns to next is a take-up of its own
            self._tail, self._task = self._task, None
            try:
                await refused()
            finally:
                if self._tail is asyncio.current_task():
                    self._tail = None

    async def stop(self) -> str | None:
        """End the take-up under way, if any: what it was doing then ("fetching", "measuring"),
        None where none was."""
        tail, self._tail = self._tail, None
        if tail is not None and tail is not asyncio.current_task():
            await _ended(tail)  # a refused one turning to the next job turns to none
        task = self._task
        if task is None or task.done():
            return None
        doing = "fetching" if self.fetching else "measuring"
        await _ended(task)
        self._task = None
        return doing

    async def settled(self) -> None:
        """Wait until no take-up is under way (one refused may have started the next)."""
        while (task := self._task) is not None and not task.done():
            await asyncio.wait({task})


async def _ended(task: asyncio.Task[None]) -> None:
    """Cancel `task` and wait for it; the caller's own cancellation meanwhile is raised."""
    before = cancels()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        if cancelled_since(before):  # the caller's own cancel: not swallowed
            raise
