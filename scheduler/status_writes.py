"""A job's state and message as the scheduler writes them to its store (`Scheduler._set`), and
what becomes of one the store refuses (a full disk: `StoreWriteError`).

Before, a refused write raised out of the job's task; its last attempt at recording the failure
was refused alike, and the job was left with nothing running it while `swarm status` showed its
old state for good (after a restart it was placed and trained again, a finished one too). Now a
refused write is held:
- said at ERROR, and in the job's status as a warning (its stored state is the last written);
- tried again, backing off, until the store takes it or a newer write of the job does;
- a job's end (succeeded, failed) waits until it is written (`written`): the job's task, and
  what it holds, stays until then, as the final model's save does."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from scheduler.history import History, state_change_text
from scheduler.store import JobState, JobStore, StoreWriteError
from swarm.errors import SwarmError
from swarm.job.states import moves
from swarm.policy.backoff import Backoff

__all__ = ["StatusWrites"]

log = logging.getLogger(__name__)

RETRY_S = (1.0, 60.0)  # the first and the longest pause between tries of a held write


@dataclass(frozen=True)
class _Held:
    """A write the store refused, and why."""

    state: JobState | None
    message: str
    error: str | None
    event: bool  # the state's change is a history event (`History.record`)
    why: str


class StatusWrites:
    def __init__(
        self,
        store: JobStore,
        history: History,
        announce: Callable[[str], Awaitable[None]],
        retry_s: tuple[float, float] = RETRY_S,
    ) -> None:
        """`announce(job_id)`: publish the job's stored record, after each write it took."""
        self.store, self.history, self.announce, self.retry_s = store, history, announce, retry_s
        self._held: dict[str, _Held] = {}
        self._retries: dict[str, asyncio.Task[None]] = {}

    async def set(
        self,
        job_id: str,
        state: JobState | None = None,
        message: str = "",
        *,
        error: str | None = None,
        event: bool = True,
    ) -> bool:
        """Write the job's `state` (None: as it is) and `message` (and `error`, when given), and
        announce it; True once the store holds it, False where it is held. A state held before
        is still due: a newer message alone carries it."""
        before = self._held.get(job_id)
        if state is None and before is not None:
            state, error, event = before.state, before.error or error, before.event
        why = self._write(job_id, state, message, error, event)
        if why is None:
            self._held.pop(job_id, None)
            await self.announce(job_id)
            return True
        self._held[job_id] = _Held(state, message, error, event, why)
        log.error(
            "job %s: %s; held, and written once the store has room (its status shows the last "
            "written)",
            job_id,
            why,
        )
        retry = self._retries.get(job_id)
        if retry is None or retry.done():
            self._retries[job_id] = asyncio.get_running_loop().create_task(self._retry(job_id))
        return False

    async def written(
        self,
        job_id: str,
        state: JobState,
        message: str,
        *,
        error: str | None = None,
        event: bool = True,
    ) -> None:
        """`set` until the store takes it: a job's end, which a restart must not undo."""
        pause = Backoff(*self.retry_s)
        while not await self.set(job_id, state, message, error=error, event=event):
            await asyncio.sleep(pause.next())

    def warning(self, job_id: str) -> str | None:
        """What `swarm status` says of a held write of the job (None: none held)."""
        held = self._held.get(job_id)
        if held is None:
            return None
        now = f"{held.state}: {held.message}" if held.state else held.message
        return f"the job store refused a write ({held.why}); held until it has room: {now}"

    def close(self) -> None:
        """The scheduler stops: no held write is tried again (a restart reads the store)."""
        for retry in self._retries.values():
            retry.cancel()
        self._retries.clear()

    def forget(self, job_id: str) -> None:
        """The job has ended (or is deleted): nothing of it is written any more."""
        self._held.pop(job_id, None)
        retry = self._retries.pop(job_id, None)
        if retry is not None:
            retry.cancel()

    async def _retry(self, job_id: str) -> None:
        pause = Backoff(*self.retry_s)
        while (held := self._held.get(job_id)) is not None:
            await asyncio.sleep(pause.next())
            if self._held.get(job_id) is not held:
                continue  # a newer write of the job: held (tried on) or taken
            try:
                why = self._write(job_id, held.state, held.message, held.error, held.event)
            except SwarmError as e:  # deleted meanwhile, say: nothing to hold any more
                log.warning("job %s: its held write is dropped: %s", job_id, e)
                why = None
            if why is None:
                del self._held[job_id]
                log.info("job %s: the job store took its held write", job_id)
                await self.announce(job_id)

    def _write(
        self,
        job_id: str,
        state: JobState | None,
        message: str,
        error: str | None,
        event: bool,
    ) -> str | None:
        """None once the store holds it (or there is nothing to write: the job is deleted or
        finished, or can no longer become `state`); else why not (the store's words). A state
        the stored one cannot move to at once (a newer write over a held one: queued, then
        running) is reached through the states between (`moves`)."""
        record = self.store.get(job_id)
        if record is None or record.finished:
            return None  # deleted, or ended (cancelled meanwhile): nothing more of it is written
        steps = moves(record.state, state) if state else []
        if steps is None:
            log.warning(
                "job %s is %s: it cannot become %s; not written", job_id, record.state, state
            )
            return None
        try:
            for then in steps:
                self.store.set_state(job_id, then, message=message, error=error)
            if steps and event:
                assert state is not None
                self.history.record(job_id, "state", state_change_text(record, state, message))
            elif not steps and message != (record.message or ""):
                self.store.set_message(job_id, message)
                log.info("job %s: %s", job_id, message)
        except StoreWriteError as e:
            return str(e)
        return None
