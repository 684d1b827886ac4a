"""A lease's long poll: with nothing to give, a trainer's lease waits until something changed
(work given back, a step opened or complete, the members changed, the job done or failed), so
that idle trainers ask rarely and still start at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from swarm.rpc.lease import Lease, Replica

__all__ = ["LongPoll"]


class LongPoll:
    MAX_WAIT_S = 60.0  # the longest a lease waits for work (a trainer's wait_s is capped here)
    _RECHECK_S = 0.5  # a waiting lease looks again this often (members, expired leases)

    def __init__(
        self, finished: asyncio.Event, commits: Callable[[], set[asyncio.Task[bool]]]
    ) -> None:
        """`finished`: set once the job is done or failed; `commits()`: the commits running
        (a commit's end may leave replays to lease)."""
        self.finished, self.commits = finished, commits
        self._changed = asyncio.Event()  # set (and replaced) when waiting leases should look

    def wake(self) -> None:
        """Waiting leases look again (work may be there, or the job done)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def poll(
        self, look: Callable[[], Lease], wait_s: float, closed: Callable[[], bool]
    ) -> Lease:
        """`look()` until it gives tasks, says the job is done, the members it names change,
        or `wait_s` (capped at `MAX_WAIT_S`) have passed; looking again whenever woken."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(wait_s, 0.0), self.MAX_WAIT_S)
        seen: list[list[Replica]] | None = None
        while True:
            changed = self._changed  # before looking: a change after the look wakes this wait
            lease = look()
            if lease.tasks or lease.done or closed():
                return lease
            if seen is None:
                seen = lease.replicas
            elif lease.replicas != seen:
                return lease  # the trainer must re-route (a replica left, moved or joined)
            left = deadline - loop.time()
            if left <= 0:
                return lease
            await self._until_changed(changed, min(left, self._RECHECK_S))

    async def _until_changed(self, changed: asyncio.Event, timeout: float) -> None:
        waiter = asyncio.ensure_future(changed.wait())
        waits: set[asyncio.Future[Any]] = {waiter, asyncio.ensure_future(self.finished.wait())}
        try:
            await asyncio.wait(
                waits | self.commits(), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for w in waits:
                # Never a commit, even once the step it committed is history: it may still
                # be telling the world (`on_step`) after opening the next step.
                if not w.done():
                    w.cancel()
