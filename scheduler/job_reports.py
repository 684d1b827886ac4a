"""What one attempt at training a job tells the job's store, its events and `swarm status`, as
the coordinator calls back: a committed step, a rollback, a replica left out or replayed, a ban.

Why one object: a rollback's message names the bans since the last one (its cause), and stays
the job's message until `NEWS_SAID_STEPS` steps have committed past it; any other news ages the
same way. So the callbacks share what was said and when, and that lives exactly as long as the
attempt. Committed steps reach the store before they are announced: `swarm status` and a
restarted scheduler read the store.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from scheduler.coordinator.trust.standing import Ban
from scheduler.history import History
from scheduler.speed import RecentSpeed
from scheduler.store import JobState, JobStore, StoreError
from swarm.bus.connection import BusLike
from swarm.ops.progress import StepRecord
from swarm.proto import control_pb2 as cpb

__all__ = ["NEWS_SAID_STEPS", "AttemptReports"]

# News (a rollback, a replica left out, a stage served again) stays the job's message for this
# many committed steps; then "training" again (the job's events keep it). Issue 51: only the
# rollback's went, the rest stayed the message long after its event ended.
NEWS_SAID_STEPS = 20

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _News:
    """The job's message while it trains, and the step it was first seen at: once
    `NEWS_SAID_STEPS` steps have committed under the same words, it is history."""

    text: str = ""
    since: int = 0

    def aged(self, message: str, step: int) -> bool:
        """Whether `message`, seen now at `step`, has outlived its event."""
        if message in ("", "training"):
            self.text = ""
            return False
        if message != self.text:
            self.text, self.since = message, step
            return False
        return step >= self.since + NEWS_SAID_STEPS


@dataclass
class AttemptReports:
    """The coordinator's callbacks for one attempt (`committed`, `rolled_back`, `status`,
    `banned`), and the job's message as the attempt starts (`opening`)."""

    job_id: str
    store: JobStore
    bus: BusLike
    history: History
    announce: Callable[[str], Awaitable[None]]  # publish the job's stored record
    set_status: Callable[[str, JobState | None, str], Awaitable[None]]  # store it, then announce
    speed: RecentSpeed  # the job's samples/s over its recent steps
    _said: list[str] = field(default_factory=list)  # what a rollback said, kept past the start
    _news: _News = field(default_factory=_News)  # any other message said while steps commit
    _rolled: list[int] = field(default_factory=list)  # the steps rolled back to
    # peers banned since the last rollback (its cause then); those kept whose rollback never
    # ran (the scheduler stopped first) roll back at this attempt's first lease
    _bans: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self._bans = [ban.peer for ban in self.store.bans(self.job_id) if not ban.replayed]

    @property
    def opening(self) -> str:
        """The message the job runs under: a rollback's said during the start stays."""
        return self._said[-1] if self._said else "training"

    def message(self) -> str:
        """The job's stored message (what `swarm status` shows now)."""
        record = self.store.get(self.job_id)
        return record.message if record else ""

    async def committed(self, record: StepRecord) -> None:
        """A step committed (or the final evaluation ran): stored, then announced."""
        if record.val_loss is not None:
            self._record_eval(record.step, record.val_loss)
        if record.final_evaluation:
            await self.announce(self.job_id)
            return
        try:
            self.store.record_step(
                self.job_id, record.step, record.loss, record.samples, record.seconds
            )
        except StoreError as e:  # a full disk: the store writes it with the next step
            log.error("job %s: %s", self.job_id, e)
        self.speed.committed(record.samples)
        log.debug("job %s step %d loss %.4f", self.job_id, record.step, record.loss)
        await self._age_news(record.step)
        await self.bus.publish(
            self.bus.topics.steps(self.job_id),
            cpb.StepCommitted(
                job=self.job_id,
                step=record.step,
                loss=record.loss,
                samples=record.samples,
                time=time.time(),
                val_loss=record.val_loss,
            ),
            retain=True,
        )
        await self.announce(self.job_id)

    def _record_eval(self, step: int, val_loss: float) -> None:
        log.info("job %s validation loss %.4f after %d steps", self.job_id, val_loss, step)
        try:
            self.store.record_eval(self.job_id, step, val_loss)
        except StoreError as e:  # a full disk: the next evaluation says it anew
            log.error("job %s: %s", self.job_id, e)

    async def _age_news(self, step: int) -> None:
        """Steps commit, so a message whose event has passed gives way to "training"."""
        if self._said and step >= self._rolled[-1] + NEWS_SAID_STEPS:
            # The rollback is history now (its event stays): the message says what is.
            if self.message() == self._said[-1]:
                await self.set_status(self.job_id, None, "training")
            self._said.clear()
        elif self._news.aged(self.message(), step):
            await self.set_status(self.job_id, None, "training")

    async def rolled_back(self, step: int, missed: str = "") -> None:
        """The coordinator rolled the job back to `step`: said with its cause, the bans since
        the last rollback or a stage that lost every replica (and, `missed`, why no standby
        took it)."""
        self.store.rewind(self.job_id, step)
        self._rolled.append(step)
        self.speed.start()  # training starts again now: the stall is not its speed
        cause = f"{', '.join(self._bans)} banned" if self._bans else "a stage lost every replica"
        if missed and not self._bans:  # why no standby took the stage: the rollback names it
            cause = f"{cause}: {missed}"
        self._bans.clear()
        self._said.append(
            f"rolled back to step {step}: {cause}; training from the last checkpoint"
            if step
            else f"rolled back to step 0 (no checkpoint): {cause}; training again from the start"
        )
        self.history.record(self.job_id, "rollback", self._said[-1])
        await self.set_status(self.job_id, None, self._said[-1])

    async def status(self, text: str) -> None:
        """The coordinator's news: a replica left out, a replay."""
        self.history.record(self.job_id, "commit", text)
        await self.set_status(self.job_id, None, text)

    async def banned(self, ban: Ban) -> None:
        """A peer an audit caught lying, with the evidence: the cause of the next rollback."""
        self._bans.append(ban.peer)
        self.history.record(self.job_id, "ban", ban.text)
        await self.set_status(self.job_id, None, ban.text)
