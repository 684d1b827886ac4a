"""When the coordinator rolls every stage back to the last sealed checkpoint (`recovery` moves
the states): once a stage that lost every replica has one again (no work can be exact without
that stage's state), or at a start where every stage has members but some none with the trained
state, or every one is behind the last checkpoint; or, once a peer is banned, to the last one
before its first step (`to`: `scheduler.coordinator.trust.bans`). One rollback at a time; one that
could not finish (a stage's replica failed to load) is tried again, backing off."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable

from scheduler.coordinator.holders import await_holders, look
from scheduler.coordinator.live_steps import LiveSteps
from scheduler.coordinator.membership import Membership
from scheduler.coordinator.metrics import CoordinatorMetrics
from scheduler.coordinator.reconcile import reconcile
from scheduler.coordinator.recovery import Recovery
from scheduler.coordinator.round_strategy import Rounds
from scheduler.coordinator.status_news import tell
from swarm.clock import Clock
from swarm.errors import SwarmError
from swarm.job.config import JobConfig
from swarm.policy.backoff import Backoff
from swarm.rpc.lease import Replica, Task

__all__ = ["Rollback"]

log = logging.getLogger(__name__)


class Rollback:
    def __init__(
        self,
        job: JobConfig,
        clock: Clock,
        window: LiveSteps,
        rounds: Rounds,
        membership: Membership,
        recovery: Recovery,
        metrics: CoordinatorMetrics,
        members: Callable[[], list[list[Replica]]],
        *,
        open_step: Callable[[int], None],
        on_rollback: Callable[[int], Awaitable[None] | None] | None,
        wake: Callable[[], None],
        fail: Callable[[BaseException], None],
        on_status: Callable[[str], Awaitable[None] | None] | None = None,
        barred: Callable[[list[int]], dict[int, list[str]]] | None = None,
    ) -> None:
        """`members()`: per stage, the replicas serving it now; `open_step(step)` opens the
        step rolled back to; `on_rollback(step)` tells the world; `wake()`: leases look again;
        `fail(error)`: the job fails with `error`; `on_status(text)`: what `swarm status` should
        say meanwhile (a rollback that waits, and for what); `barred(stages)`: the servers on
        those stages that are banned from the job, by stage (why they count as none)."""
        self.job, self.clock, self.window, self.rounds = job, clock, window, rounds
        self.membership, self.recovery, self.metrics, self.members = (
            membership,
            recovery,
            metrics,
            members,
        )
        self.open_step, self.on_rollback, self.wake, self.fail = open_step, on_rollback, wake, fail
        self.on_status, self.barred = on_status, barred
        self._waiting: tuple[int, ...] | None = None  # the silent stages a wait was said for
        self._unloaded: str | None = None  # the stages no replica loaded, and whose, said last
        self.error: BaseException | None = None  # what failed the job, if a rollback did
        self._task: asyncio.Task[None] | None = None
        self._backoff = Backoff(first_s=0.5, cap_s=30.0)
        self._after = -math.inf
        self._before: int | None = None  # a ban's: roll back to a checkpoint at or before this
        self.rolled = 0  # rollbacks done: a round's id after one is its step's anew
        # The epoch the work leased now carries (`swarm.rpc.epoch`): each rollback's is newer
        # than the last, and from the wall clock (milliseconds) so that a scheduler restarted,
        # its count of rollbacks at 0 again, still leases work newer than a replica last saw.
        self.leasing = time.time_ns() // 1_000_000
        # A replica that joins after a rollback got no LoadState of it: its Join says the epoch.
        membership.epoch = lambda: self.leasing

    @property
    def epoch(self) -> str:
        """What a round's id carries after a rollback ("" before one): the steps replayed
        average again under ids of their own."""
        return f"r{self.rolled}" if self.rolled else ""

    def stamped(self, tasks: list[Task]) -> list[Task]:
        """`tasks` as leased now: of this epoch, which a rollback's state loads retire."""
        return [dataclasses.replace(t, epoch=self.leasing) for t in tasks]

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def opened(self) -> None:
        """A step opened: the next rollback needs no backing off."""
        self._backoff.reset()
        self._after = -math.inf

    def cancel(self) -> None:
        self._before = None  # closed: no ban's rollback is tried again
        if self._task is not None:
            self._task.cancel()

    def to(self, step: int) -> None:
        """A peer whose work starts at `step` was banned: roll every stage back to the last
        checkpoint at or before `step` (none after it is kept), whatever the members."""
        self._before = step if self._before is None else min(self._before, step)
        if self._task is None:
            self._task = asyncio.create_task(self.run())

    def maybe(self) -> None:
        """A stage has lost every replica. Once a replica of it is back, roll every stage back to
        the last complete checkpoint (no work can be exact without that stage's state)."""
        if self._task is None and all(self.members()):
            now = self.clock.now()
            if now < self._after:
                return  # the last attempt failed: back off
            self._after = now + self._backoff.next()
            self._task = asyncio.create_task(self.run())

    async def run(self) -> None:
        before, done = self._before, False
        try:
            silent = await self._silent()
            if silent:
                # Loading the checkpoint on the other stages now would cost their replicas the
                # trained state for nothing (this rollback cannot finish without these stages),
                # and a replica between two paths (its relay died, it re-attaches to another)
                # may still hold its stage's state: the next try may re-admit it instead.
                await self._wait_said(silent)
                return
            self._waiting = None
            # Every stage answers now: readmission asks over the paths that answered. Asked
            # before the look, it reached a replica between two paths over the dead one, which
            # the look then found answering over the new: a rollback threw its state away.
            ledgers = self.window.ledgers()
            if (
                before is None  # a ban's rollback re-admits nobody: the state it holds is tainted
                and ledgers
                and self.rounds.readmits  # else the stage rolls back to a checkpoint
                and await self.membership.readmit(ledgers[0].step)
            ):
                self.wake()  # a replica dropped for a missed deadline still held the state
                return
            # A checkpoint still being written may be the newest.
            await self.recovery.flush(self.job.runtime.commit_timeout_s)
            step = (
                self.recovery.latest()
                if before is None
                else await self.recovery.back_before(before)
            )
            self.window.cancel_commits()
            self.rounds.restarted()  # every member loads one state: no round is half done
            # Work leased before is refused where the state loads (as late as it may land):
            # the epoch goes with the state, and the work leased once it is loaded carries it
            # (not work leased while it loads, of the step as it was before).
            rolled = max(self.leasing + 1, time.time_ns() // 1_000_000)
            self.membership.synced = await self.recovery.restore(step, self.members(), rolled)
            self.leasing = self.membership.rolled_back = rolled
            self.membership.standbys.rolled_back()  # what each held is of the old trajectory
            lost = [k for k, stage in enumerate(self.membership.replicas()) if not stage]
            if lost:  # not every stage could load it: the next lease tries again
                await self._unloaded_said(step, lost)
                return
            self._unloaded = None
            self.metrics.rollbacks.inc()
            self.rolled, done = self.rolled + 1, True
            if before is not None:
                log.warning("rolled every stage back to step %d: before a banned peer's work", step)
            elif step == 0:  # all training so far is lost: say so loudly
                log.warning("rolled every stage back to step 0 (no checkpoint): retraining")
            else:
                log.warning("rolled every stage back to step %d (checkpoint)", step)
            self.open_step(step)
            if self.on_rollback:
                said = self.on_rollback(step)
                if said is not None:
                    await said
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a damaged checkpoint, say: fail the job rather than retry forever
            log.exception("rollback failed")
            self.error = e
            self.fail(e)
        finally:
            self._task = None
            if done and self._before == before:
                self._before = None
            elif self._before is not None and self.error is None:  # not done, or another ban
                asyncio.get_running_loop().call_later(self._backoff.next(), self._again)

    def _again(self) -> None:
        if self._task is None and self._before is not None:
            self._task = asyncio.create_task(self.run())

    async def _wait_said(self, silent: list[int]) -> None:
        """Say that the rollback waits for `silent` stages: at WARNING and in the job's status
        when it starts waiting for them, at INFO at each try after (every backoff, up to 30 s):
        a job stalled this way must not read as running, nor fill the log."""
        stages = (
            "stages " + ", ".join(map(str, silent)) if len(silent) > 1 else f"stage {silent[0]}"
        )
        text = f"rollback waits: no replica of {stages} answers; it goes on once one does"
        if tuple(silent) == self._waiting:
            log.info("%s", text)
            return
        self._waiting = tuple(silent)
        log.warning("%s", text)
        await tell(self.on_status, text)  # news: a status that fails to take it fails no job

    async def _unloaded_said(self, step: int, lost: list[int]) -> None:
        """Say (in the job's status, once while it stays so) which stages no replica loaded
        the rollback's state on, and each of their replicas' cause: such a rollback is tried
        again at every backoff, and can end only once one loads it (a replica with memory
        freed, another peer)."""
        members = self.members()
        failed = [r.peer for k in lost for r in members[k] if r.peer in self.recovery.unloaded]
        causes = "; ".join(f"{peer}: {self.recovery.unloaded[peer]}" for peer in failed)
        stages = ("stages " if len(lost) > 1 else "stage ") + ", ".join(map(str, lost))
        text = (
            f"rollback to step {step}: no replica of {stages} loaded its state "
            f"({causes or 'none serves it'}); tried again"
        )
        # Said once for these stages and replicas: their causes' words may change at each try
        # (torch's free memory), and each saying is an event of the job's history.
        said = f"{step} {lost} {failed}"
        if said == self._unloaded:
            log.info("%s", text)
            return
        self._unloaded = said
        log.warning("%s", text)
        await tell(self.on_status, text)

    async def _silent(self) -> list[int]:
        """The stages none of whose replicas answers Info now."""
        seen = await look(self.membership)
        answering = {k for k, _, a in seen.answers if not isinstance(a, BaseException)}
        return [k for k in range(seen.stages) if k not in answering]

    async def reconcile(self, recorded: int | None = None, wait_s: float = 0.0) -> int:
        """At a start: the step every replica is brought to (finishing a half-applied commit),
        rolling every stage back first where that step cannot be trained from. `recorded`: the
        job's step as its store has it (None: no store), whose holders are waited for `wait_s`
        at most (`holders`)."""
        if recorded is not None:  # a checkpoint sealed past the store's record (held) counts
            recorded = max(recorded, self.recovery.latest())
        if recorded is None:
            seen = await look(self.membership)
        else:
            seen = await await_holders(
                self.membership, recorded, wait_s, self.clock, self.on_status
            )
        target = await reconcile(self.membership, seen, recorded)
        if recorded is not None and target < recorded and self.recovery.latest() < recorded:
            log.warning(
                "no replica holds the job's recorded step %d: resuming from step %d; steps "
                "%d..%d are trained again",
                recorded,
                max(target, self.recovery.latest()),
                max(target, self.recovery.latest()),
                recorded - 1,
            )
        missing = [k for k, replicas in enumerate(self.membership.replicas()) if not replicas]
        saved = self.recovery.latest()
        if (missing or saved > target) and all(self.members()):
            if saved > target:
                # Every replica is behind the last sealed checkpoint (all restarted empty, say):
                # training again from `target` would throw the checkpointed steps away.
                log.warning(
                    "every replica is at step %d or before: resuming from the checkpoint of "
                    "step %d",
                    target,
                    saved,
                )
            else:
                # Every stage has members but some none with the trained state (a stage was
                # lost while no coordinator ran): every stage goes back to the last checkpoint.
                log.warning("no replica of stages %s is at step %d: rolling back", missing, target)
            await self.run()
            if self.error is not None:
                raise self.error
            newest = self.window.newest
            if newest is not None and all(self.membership.replicas()):
                return newest.ledger.step
            missing = [k for k, replicas in enumerate(self.membership.replicas()) if not replicas]
        if missing:
            raise SwarmError(
                f"no replica of stages {missing} is at step {target}" + self._why(missing)
            )
        return target

    def _why(self, missing: list[int]) -> str:
        """Why `missing` stages have no replica when the servers on them are banned from the
        job, or when theirs did not answer at all: not a replica behind, but one nobody can dial
        (issue 42: a peer behind NAT was assigned and served nothing); "" when they answered."""
        banned = {k: p for k, p in (self.barred(missing) if self.barred else {}).items() if p}
        if banned:
            who = "; ".join(f"stage {k}: {', '.join(p)}" for k, p in sorted(banned.items()))
            return (
                f": the servers on it are banned from this job ({who}); start a stage server "
                "for it, which takes the stage"
            )
        silent = {
            k: self.membership.unanswered[k] for k in missing if k in self.membership.unanswered
        }
        if not silent:
            return ""
        who = "; ".join(f"stage {k}: {', '.join(v)}" for k, v in sorted(silent.items()))
        return (
            f": its replicas did not answer ({who}); a replica nobody can dial serves nothing: "
            "give its stage server --announce-host with an address others reach it at, forward "
            "its port, or start a relay (`swarm relay`, or a stage server with `--relay`)"
        )
