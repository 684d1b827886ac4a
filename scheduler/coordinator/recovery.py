"""Checkpoints and rollback: every `checkpoint_every` steps (and, given `every_s`, at the first step
boundary after that long without one, so that a rollback costs minutes, not the job: a stage can
lose its only replica at any time) each stage's state is saved from one member and the checkpoint
sealed, and the sealed ones but the newest `keep_checkpoints` deleted;
when a stage has lost every replica, every stage goes back to the last sealed checkpoint (or to
step 0's initial state when there is none)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from scheduler.coordinator.replicas import ReplicaClients
from scheduler.coordinator.status_news import OnStatus, tell
from swarm.clock import Clock, MonotonicClock
from swarm.deadline import settled
from swarm.errors import SwarmError
from swarm.job.config import JobConfig
from swarm.job.rule import rule_of
from swarm.model import checkpoint, stage_state
from swarm.model.optim import is_boundary
from swarm.rpc.lease import Replica

__all__ = ["Recovery", "to_thread_to_the_end"]

log = logging.getLogger(__name__)
T = TypeVar("T")


async def to_thread_to_the_end(fn: Callable[..., T], *args: Any) -> T:
    """`asyncio.to_thread(fn, *args)` for a thread that writes files: a caller cancelled meanwhile
    still waits for it to end, then is cancelled. Cancelling a task does not stop its thread, and
    a write that outlived its job's task could make a deleted job's directory again, files no
    record names (DeleteJob and retention wait for the job's task, so for its writes)."""
    future = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        await settled(future)
    except asyncio.CancelledError:
        if not future.cancelled():
            future.exception()  # retrieved: the cancellation is what the caller gets
        raise
    return future.result()


# While checkpoints keep failing for one cause, it is said again this often (seconds): the
# job's status moves on (its message, its newest events), and the operator must still see it.
RETOLD_S = 3600.0


class _OtherStep(Exception):
    """A replica's state is of another step than the checkpoint's."""


class Recovery:
    def __init__(
        self,
        job: JobConfig,
        clients: ReplicaClients,
        directory: Path | None,
        every_s: float | None = None,
        clock: Clock | None = None,
        on_status: OnStatus | None = None,
    ) -> None:
        """`every_s`: checkpoint at least this often (seconds of `clock`) besides every
        `checkpoint_every` steps; None: by steps only. `on_status(text)`: what `swarm status`
        should say (a checkpoint not written, and once one is again)."""
        self.job, self.clients, self.directory = job, clients, directory
        self.on_status = on_status
        self.unloaded: dict[str, str] = {}  # the last restore's replicas that did not load, why
        # Why the last checkpoint was not written, and when that was said; None: it was.
        self._failing: tuple[str | None, float] | None = None
        self.every_s, self.clock = every_s, clock or MonotonicClock()
        self._last_at = self.clock.now()  # the last checkpoint started (or training did)
        self._saving: asyncio.Task[None] | None = None  # the checkpoint being written
        # The steps the bans' rollbacks went back to (`back_before`), in order: a checkpoint
        # being written as one came holds the banned peer's work if it is of a later step.
        self._bans: list[int] = []
        # A ban's rollback under way goes back to this step: until it has loaded that state
        # (`restore`), a step after it is the banned trajectory's, and is not checkpointed.
        self._going_back: int | None = None
        # Checkpoints of a banned peer's work its rollback could not delete (the disk keeps
        # them: read-only, another's): never gone back to (`latest`, `back_before`).
        self._tainted: set[int] = set()

    def checkpoint(self, step: int, members: list[list[Replica]]) -> None:
        """Write the checkpoint of `step` in the background while the next steps train; skipped
        (with a warning) while the one before is still being written, so training never waits."""
        self._last_at = self.clock.now()
        if self._saving is not None and not self._saving.done():
            log.warning("checkpoint of step %d skipped: the one before is still written", step)
            return
        if self._going_back is not None and step > self._going_back:
            log.warning(
                "checkpoint of step %d skipped: a ban's rollback to step %d is under way (the "
                "state of step %d holds the banned peer's work)",
                step,
                self._going_back,
                step,
            )
            return
        # the bans so far: one from now on may drop it (`_banned_since`), its task not begun yet
        self._saving = asyncio.create_task(self._checkpoint(step, members, len(self._bans)))

    async def _checkpoint(self, step: int, members: list[list[Replica]], bans: int) -> None:
        try:
            missing = await self.save(step, members, bans)
            cause = missing
        except OSError as e:  # a full or broken disk: training goes on without this one
            log.error("checkpoint of step %d not written: %s", step, e)
            missing, cause = str(e), f"{type(e).__name__} {e.errno}"  # its text names the step
        await self._told(step, missing, cause)

    async def _told(self, step: int, missing: str | None, cause: str | None) -> None:
        """Say in the job's status that checkpoints are not written (once while the `cause`
        stays, and again each `RETOLD_S` while it does: a full disk fails each of them, and a
        job's status moves on), and that they are written again: a job whose checkpoints fail
        rolls back further at its next lost stage, which its operator should know before."""
        if missing == "":
            return  # dropped for a ban, as it said
        now = self.clock.now()
        if missing is None:
            text = f"checkpoints are written again: step {step}'s is sealed"
            said, self._failing = self._failing is not None, None
        else:
            latest = self.latest()
            text = (
                f"checkpoint of step {step} not written ({missing}): a rollback goes back to "
                f"step {latest}, the last written"
            )
            last = self._failing
            said = last is None or cause != last[0] or now - last[1] >= RETOLD_S
            if said:
                self._failing = (cause, now)
        if said:
            log.warning("%s", text)
            await tell(self.on_status, text)

    async def flush(self, timeout_s: float | None = None) -> None:
        """Wait (at most `timeout_s`) until the checkpoint being written is sealed or skipped."""
        if self._saving is not None:
            await asyncio.wait([self._saving], timeout=timeout_s)

    async def close(self, finished: bool) -> None:
        """Let the job's last checkpoint end when the job `finished`; cancel it otherwise."""
        saving = self._saving
        if saving is None:
            return
        try:
            if finished:
                await self.flush(self.job.runtime.commit_timeout_s)
        finally:  # a close cancelled while it waited still ends the write (a `swarm cancel`)
            saving.cancel()
            # It ends once its write threads have (`to_thread_to_the_end`); wait for that even
            # when this close is cancelled: the job is not shut down while a thread still writes.
            await settled(saving)
            if not saving.cancelled():
                saving.exception()  # retrieved (the task logs what it must)

    def due(self, step: int) -> bool:
        """Whether the state at `step` (just reached) is to be checkpointed: every
        `checkpoint_every` steps, or once `every_s` have passed since the last one (with
        pool.mode = "local", only where a round starts: replicas share parameters only there)."""
        if not self.directory:
            return False
        every = self.job.training.checkpoint_every
        if every and step % every == 0:
            return True
        if self.every_s is None or self.clock.now() - self._last_at < self.every_s:
            return False
        return not rule_of(self.job).rounds or is_boundary(self.job, step)

    async def save(
        self, step: int, members: list[list[Replica]], bans: int | None = None
    ) -> str | None:
        """Save every stage's state at `step` (from one member each), then seal it, unless a ban
        after the `bans`th (by default: after this call) went back before `step`. A write that
        fails raises `OSError` (`checkpoint.CheckpointError`) with the unsealed files removed:
        the caller skips this checkpoint, and a rollback uses the last sealed one. A save
        cancelled midway removes them too: its stages already written are of no use alone.
        Returns None once sealed, "" when dropped for a ban, else why it was not written."""
        assert self.directory is not None
        try:
            return await self._save(
                self.directory, step, members, len(self._bans) if bans is None else bans
            )
        except (OSError, asyncio.CancelledError):  # cancelled: a job's end, a shutdown
            await to_thread_to_the_end(checkpoint.discard, self.directory, step)
            raise

    async def _save(
        self, directory: Path, step: int, members: list[list[Replica]], bans: int
    ) -> str | None:
        # Every stage at once: each replica snapshots its state when the download reaches it,
        # so all do so at `step`, before the next commit, however long the transfers take.
        # Every stage's write ends before a failure is raised: the caller's discard must not
        # run while another stage's thread still writes (its directory would outlive it).
        saved = await asyncio.gather(
            *(self._save_stage(directory, step, k, replicas) for k, replicas in enumerate(members)),
            return_exceptions=True,
        )
        for failed in saved:
            if isinstance(failed, BaseException):
                raise failed
        silent = [k for k, ok in enumerate(saved) if not ok]
        if silent or self._banned_since(bans, step):
            await to_thread_to_the_end(checkpoint.discard, directory, step)  # never sealed
            return f"no replica of stage {silent[0]} gave its state at it" if silent else ""
        await to_thread_to_the_end(checkpoint.seal, directory, step, self.job.training.stages)
        if self._banned_since(bans, step):  # banned while it was sealed: gone as the ban said
            await to_thread_to_the_end(self._drop_after, min(self._bans[bans:]))
            return ""
        log.info("checkpoint of step %d written to %s", step, directory)
        keep = self.job.training.keep_checkpoints
        try:  # after the seal: the newest sealed one is never the one deleted
            pruned = await to_thread_to_the_end(checkpoint.prune, directory, keep)
        except OSError as e:  # the checkpoint is sealed; the old ones go next time
            log.warning("checkpoints before step %d not deleted: %s", step, e)
        else:
            if pruned:
                log.info("checkpoints of steps %s deleted: the %d newest are kept", pruned, keep)
        return None

    def _banned_since(self, bans: int, step: int) -> bool:
        """Whether a ban since the `bans`th went back before `step` (said): the checkpoint of
        `step`, begun before it, holds the banned peer's work, and the ban's deletion of such
        checkpoints (`back_before`) came before it was sealed."""
        if not any(back < step for back in self._bans[bans:]):
            return False
        log.warning(
            "checkpoint of step %d dropped: a peer banned while it was written did work in it",
            step,
        )
        return True

    async def _save_stage(
        self, directory: Path, step: int, stage: int, replicas: list[Replica]
    ) -> bool:
        for r in replicas:  # the first member that answers at `step`
            try:
                if await self._stream_stage(directory, step, stage, r):
                    return True
            except SwarmError as e:
                log.warning("checkpoint %d: %s did not answer: %r", step, r.peer, e)
        log.warning("checkpoint %d skipped: no replica of stage %d answered at it", step, stage)
        return False

    async def _stream_stage(self, directory: Path, step: int, stage: int, r: Replica) -> bool:
        """Stream `r`'s state into stage `stage`'s file as it comes (never held whole here: a
        stage's state may be larger than this process's memory); False when `r` is at another
        step (nothing is written then). A failed write raises `CheckpointError`."""
        replica = self.clients.get(stage, r)
        most = await replica.max_state_tensors()
        writer = checkpoint.StageWriter(directory, step, stage, most)  # its file opens in `add`
        try:

            async def write(at: int, name: str, tensor: torch.Tensor) -> None:
                if at != step:
                    raise _OtherStep(at)
                await to_thread_to_the_end(writer.add, name, tensor)

            try:
                await replica.stream_state(write, include_optimizer=True)
            except _OtherStep:
                return False
            await to_thread_to_the_end(writer.close)
            return True
        finally:
            writer.abort()  # whatever was not closed (no write thread runs now)

    async def sweep(self) -> None:
        """At the coordinator's start, before it writes a checkpoint: what a write that never
        ended left (a scheduler killed mid-checkpoint) is removed, on a thread."""
        if not self.directory or not self.directory.is_dir():
            return
        gone = await to_thread_to_the_end(checkpoint.sweep, self.directory)
        if gone:
            log.warning("checkpoint writes that never ended removed: %s", ", ".join(gone))

    def latest(self) -> int:
        """The step to roll back to: the last sealed checkpoint's, else 0."""
        return self._sealed_at_most(math.inf)

    def _sealed_at_most(self, at_most: float) -> int:
        """The last sealed checkpoint's step at or before `at_most` but a banned peer's work's
        (`_tainted`), else 0."""
        if not self.directory:
            return 0
        sealed = checkpoint.sealed(self.directory)
        return max((s for s in sealed if s <= at_most and s not in self._tainted), default=0)

    def _drop_after(self, step: int) -> list[int]:
        """On a thread: `checkpoint.drop_after`, the ones the disk kept remembered as tainted."""
        assert self.directory is not None
        after = [s for s in checkpoint.named(self.directory) if s > step]
        dropped = checkpoint.drop_after(self.directory, step)
        self._tainted.update(set(after) - set(dropped))
        return dropped

    async def back_before(self, at_most: int) -> int:
        """The step a ban's rollback goes back to: the last sealed checkpoint's at or before
        `at_most`, else 0. The sealed ones after it are deleted, on a thread (each a model and
        its optimizer's state: seconds of disk work the event loop must not wait out): they
        hold work done after `at_most`, a banned peer's (`scheduler.coordinator.trust.bans`)."""
        if not self.directory:
            return 0
        step = self._sealed_at_most(at_most)
        self._bans.append(step)  # and the one being written, if after it (`_banned_since`)
        self._going_back = step  # and those begun before the states are loaded (`restore`)
        dropped = await to_thread_to_the_end(self._drop_after, step)
        if dropped:
            log.warning("checkpoints of steps %s deleted: they hold a banned peer's work", dropped)
        return step

    async def restore(self, step: int, members: list[list[Replica]], epoch: int = 0) -> set[str]:
        """Load the state at `step` on every replica of every stage, from which on each refuses
        work leased before rollback `epoch` (`swarm.rpc.epoch`); returns the peers that loaded it
        (the members from now on)."""
        loaded: set[str] = set()
        self.unloaded = {}
        for stage, replicas in enumerate(members):
            state = await asyncio.to_thread(self.stage_state, step, stage)
            for r in replicas:
                try:
                    await self.clients.get(stage, r).load_state(step, state, epoch)
                    loaded.add(r.peer)
                except SwarmError as e:
                    log.warning("rollback: %s could not load step %d: %s", r.peer, step, e)
                    self.unloaded[r.peer] = str(e)[:200]
        # Loaded where it could be: the steps checkpointed from now on are trained anew (where
        # no replica of a stage loaded it, the rollback runs again, a ban's with its `latest`).
        self._going_back = None
        return loaded

    def stage_state(self, step: int, stage: int) -> dict[str, torch.Tensor]:
        if step and self.directory:
            return checkpoint.load_stage(self.directory, step, stage)
        return stage_state.initial_state(self.job, stage)
