"""A joining replica's background copy of a member of its stage: download the member's state
(parameters, optimizer state, step s) while training goes on, then apply every update the member
applied since s, from its update log (`stage_server.replica.update_log`), and keep following its
updates until the coordinator makes this replica a member (its first PREPARE ends the following).
The coordinator asks (`Join`) at a later point where this replica is at the open step; nobody waits
for the download."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from stage_server.replica.following import Began
from stage_server.replica.runtime import StageRuntime
from swarm.deadline import within
from swarm.errors import InvalidArgument, SwarmError
from swarm.policy.backoff import Backoff
from swarm.rpc.stage_client import StageClient

__all__ = ["Copy"]

log = logging.getLogger(__name__)

Compute = Callable[..., Awaitable[Any]]  # runs a runtime method on the replica's worker thread


class Copy:
    """One copy of the replica at `source`, running as a task until this replica is a member,
    the copy fails (`error` says why; the coordinator's next `Join` starts another) or it is
    cancelled (another source, a new assignment)."""

    _POLL_FIRST_S, _POLL_CAP_S = 0.05, 1.0  # pauses between asks for new updates

    def __init__(
        self,
        source: StageClient,
        runtime: StageRuntime,
        compute: Compute,
        peer: str,
        ticket: bytes = b"",
        on_copied: Callable[[int, float], None] | None = None,
        epoch: int = 0,
    ) -> None:
        """`on_copied(nbytes, seconds)`: the state downloaded, its bytes in that time. `epoch`:
        the rollback epoch of the Join that began it, its source a member then: the copy's state
        is said to be of it once loaded (at worst older than it is: a Join sent before a
        rollback may be handled after its source loaded the rollback's state). A source that
        loads a state while this copy follows it clears its update log, and the copy fails at
        its next ask: it never follows a source across a rollback."""
        self.source, self.runtime, self.compute, self.peer = source, runtime, compute, peer
        self.epoch = epoch
        self._on_copied = on_copied
        # The scheduler's, naming this replica a follower of `source` (`Join` brought it): a
        # source the scheduler placed keeps updates only for the followers it names.
        self.ticket = ticket
        self.address = source.address
        self.error: BaseException | None = None
        self.loaded = False  # the state is downloaded and loaded: now applying updates
        self._ask = asyncio.Event()  # set: ask the source for updates now, not after a pause
        self._moved = asyncio.Event()  # set (and replaced) after each round of updates
        # Where this replica is as the copy starts: one that moves before the copy is loaded
        # (it applied a commit as a member, or a rollback loaded its state) is not overwritten
        # by it (`Following.load`).
        self._began = Began(runtime.step, runtime.loads)
        self.task = asyncio.get_running_loop().create_task(self._run())

    @property
    def running(self) -> bool:
        return not self.task.done()

    async def reach(self, step: int, timeout_s: float) -> None:
        """Fetch the source's updates now and wait (at most `timeout_s`) until this replica is
        at `step`: asked as the coordinator's step opens, the one update it lacks is there."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.running and self.runtime.following and self.runtime.copy_step < step:
            moved = self._moved
            self._ask.set()
            left = deadline - loop.time()
            if left <= 0:
                return
            try:
                await within(moved.wait(), left)
            except TimeoutError:
                return

    async def cancel(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def _run(self) -> None:
        rt = self.runtime
        try:
            # Checked as it comes (names, shapes, dtypes, a total): a source that sends what
            # this stage's state cannot hold is refused before it sizes this process's memory.
            started = time.perf_counter()
            step, state = await self.source.download_state(
                include_optimizer=True,
                prefix="",
                follower=self.peer,
                expect=rt.checks.state,
                ticket=self.ticket,
            )
            if self._on_copied is not None:
                nbytes = sum(t.nbytes for t in state.values())
                self._on_copied(nbytes, time.perf_counter() - started)
            await self._taken(rt.follow.load, step, state, self._began, self.epoch)
            self.loaded = True
            log.info(
                "%s: copied stage %d at step %d from %s", self.peer, rt.stage, step, self.address
            )
            await self._follow()
        except SwarmError as e:
            log.warning("%s: copying %s failed: %s", self.peer, self.address, e)
            self.error = e.with_traceback(None)  # its frames (the state downloaded) go now
        except Exception as e:  # torch's out of memory in the load, say: kept, not lost
            log.warning("%s: copying %s failed", self.peer, self.address, exc_info=True)
            self.error = e.with_traceback(None)
        finally:
            await self.source.close()

    async def _taken(self, method: Callable[..., Any], *args: Any) -> Any:
        """`method` (the following's load or apply) on the worker; what it refuses of the
        source's state or update names the source."""
        try:
            return await self.compute(method, *args)
        except InvalidArgument as e:
            raise InvalidArgument(f"from {self.address}: {e}") from None

    async def _follow(self) -> None:
        rt, pause = self.runtime, Backoff(self._POLL_FIRST_S, self._POLL_CAP_S)
        while rt.following:
            updates = await self.source.updates(
                self.peer, rt.step, expect=rt.checks.state, ticket=self.ticket
            )
            for update in updates:
                if not await self._taken(rt.follow.apply, update):
                    break
            self._moved.set()
            self._moved = asyncio.Event()
            if not rt.following:
                break
            if updates:
                pause.reset()
            elif not self._ask.is_set():
                with contextlib.suppress(TimeoutError):
                    await within(self._ask.wait(), pause.next())
            self._ask.clear()
        # A member now: the source may forget this follower's updates (or later, by itself).
        with contextlib.suppress(SwarmError):
            await self.source.updates(self.peer, -1, expect=rt.checks.state, ticket=self.ticket)
