"""What a running job waits for, and what the operator can do about it.

While a job trains, `StallWatch` looks every second at who serves each stage. A stage without a
replica stalls the job (no microbatch can cross it): the job's message then says which stage,
since when, what to do (start a stage server: it takes the empty stage) and what will happen
then (every stage rolls back to the last checkpoint, so many steps are trained again), and the
job waits "since" the moment the stage emptied, which `swarm status` counts up. A stage with a
single replica is a warning: losing it costs the steps since the last checkpoint, where a spare
replica would have taken over without loss. Each change is an event in the job's history.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from scheduler.history import History
from scheduler.speed import RecentSpeed
from swarm.rpc.lease import Replica

__all__ = [
    "REMEDY",
    "Health",
    "StallWatch",
    "lost_stage_text",
    "single_replica_text",
    "stages_text",
]

# Steps that stop committing for this many usual step times (and at least this long) while every
# stage is served are a stall too (a hung or very slow replica, trainers gone).
SLOW_STALL_STEPS = 20
SLOW_STALL_MIN_S = 60.0
# How often the last checkpoint's step is read from disk while no step commits (messages name it).
CHECKPOINT_LOOK_S = 10.0

REMEDY = "start a stage server for this job (`swarm stage-server --broker URL`, as for the others)"


def stages_text(stages: list[int]) -> str:
    return ("stage " if len(stages) == 1 else "stages ") + ", ".join(map(str, stages))


def lost_stage_text(missing: list[int], step: int, checkpoint: int, since: float) -> str:
    """The message of a job stalled because `missing` stages have no replica."""
    at = time.strftime("%H:%M:%S", time.localtime(since))
    verb = "has" if len(missing) == 1 else "have"
    if checkpoint > 0:
        then = f"every stage rolls back to step {checkpoint}, the last checkpoint"
        if step > checkpoint:
            then += f" ({step - checkpoint} step(s) trained again)"
    else:
        then = f"training starts again from step 0 (no checkpoint yet: {step} step(s) lost)"
    return (
        f"stalled at step {step}: {stages_text(missing)} {verb} no replica since {at}; {REMEDY}: "
        f"it takes the stage, and {then}"
    )


def single_replica_text(stages: list[int], peers: list[str], checkpoint: int) -> str:
    """The warning for `stages`, each served by one replica (`peers`, in their order)."""
    back = f"step {checkpoint}, the last checkpoint" if checkpoint else "step 0 (no checkpoint)"
    if len(stages) == 1:
        which = f"stage {stages[0]} has a single replica ({peers[0]}): if it is lost"
    else:
        which = (
            f"{stages_text(stages)} have a single replica each ({', '.join(peers)}): if one is lost"
        )
    return (
        f"{which}, training rolls back to {back}; a spare stage server would take over without loss"
    )


@dataclass
class Health:
    """A job's waiting and warnings, as `swarm status` shows them."""

    waiting_since: float = 0.0  # unix seconds; 0: not waiting
    warnings: list[str] = field(default_factory=list)


class StallWatch:
    def __init__(
        self,
        job_id: str,
        members: Callable[[], list[list[Replica]]],
        step: Callable[[], int],
        checkpoint: Callable[[], int],
        say: Callable[[str], Awaitable[None]],
        said: Callable[[], str],
        history: History,
        health: Health,
        clock: Callable[[], float] = time.time,
        speed: RecentSpeed | None = None,
        progress: Callable[[], str] = lambda: "",
        counted: Callable[[], list[list[Replica]]] | None = None,
    ) -> None:
        """`members()`: who serves each stage now; `step()`: the job's committed steps;
        `checkpoint()`: the step the last sealed checkpoint holds (0: none); `say(text)`: set the
        job's message, `said()`: what it is now; `health`: what this watch keeps current;
        `speed`: the job's commits (a job served everywhere whose steps stop is stalled too),
        `progress()`: where its open step is, in words; `counted()`: the replicas that count
        for the single-replica warning, those whose join succeeded (default: `members()`)."""
        self.job_id, self.members, self.step, self.checkpoint = job_id, members, step, checkpoint
        self.say, self.said, self.history = say, said, history
        self.health, self.clock = health, clock
        self.speed, self.progress = speed, progress
        self.counted = counted or members
        self._slow_since: float | None = None  # the last commit, while no step commits
        self._served_at = -math.inf  # when a lost stage was last served again
        # (when read, the job's step then, the checkpoint's step read)
        self._checkpoint_at: tuple[float, int, int] | None = None
        self._lost: dict[int, float] = {}  # stage -> when it was last seen with no replica
        self._single: set[int] = set()  # stages warned about
        self._said = ""

    async def look(self) -> None:
        """Take in who serves each stage now; say what changed."""
        members, now = self.members(), self.clock()
        step = self.step()
        checkpoint = self._checkpoint(now, step)
        missing = [k for k, replicas in enumerate(members) if not replicas]
        for k in missing:
            if k not in self._lost:
                self._lost[k] = now
                self.history.record(
                    self.job_id,
                    "stall",
                    f"stage {k} lost its last replica at step {step}: training stalled; {REMEDY}",
                )
        served_again = ""
        for k in [k for k in self._lost if k not in missing]:
            held = now - self._lost.pop(k)
            who = ", ".join(r.peer for r in members[k])
            self._served_at = now  # its rollback comes next: not a slow step
            served_again = f"stage {k} is served again ({who}) after {held:.0f} s without a replica"
            self.history.record(self.job_id, "resume", served_again)
        counted = self.counted()  # a replica still joining is no spare yet
        single = {k for k, replicas in enumerate(counted) if len(replicas) == 1}
        if single - self._single:  # said once as it starts, for the stages new to it
            new = sorted(single - self._single)
            text = single_replica_text(new, [counted[k][0].peer for k in new], checkpoint)
            self.history.record(self.job_id, "warning", text)
        self._single = single
        self.health.warnings = (
            [
                single_replica_text(
                    sorted(single), [counted[k][0].peer for k in sorted(single)], checkpoint
                )
            ]
            if single
            else []
        )
        slow = self._slow(now, step) if not missing else None
        if slow is not None:
            self.health.waiting_since = self._slow_since or now
            if slow != self._said:
                self._said = slow
                await self.say(slow)
        elif missing:
            since = min(self._lost.values())
            self.health.waiting_since = since
            text = lost_stage_text(missing, step, checkpoint, since)
            if text != self._said:
                self._said = text
                await self.say(text)
        else:
            self.health.waiting_since = 0.0
            # The stall's message, unless something (a rollback) has said more since.
            if self._said and self.said() == self._said:
                await self.say(f"training: {served_again}" if served_again else "training")
            self._said = ""

    def _checkpoint(self, now: float, step: int) -> int:
        """`checkpoint()`, read again when a step has committed since, or after
        `CHECKPOINT_LOOK_S` (one sealed in the background): it lists the job's checkpoint
        directory, and this looks every second."""
        cached = self._checkpoint_at
        if cached is None or cached[1] != step or now - cached[0] >= CHECKPOINT_LOOK_S:
            self._checkpoint_at = cached = (now, step, self.checkpoint())
        return cached[2]

    def _slow(self, now: float, step: int) -> str | None:
        """The message of a job whose every stage is served but whose steps stopped committing
        for `SLOW_STALL_STEPS` of its usual step times (at least `SLOW_STALL_MIN_S`), else None;
        its start and end are events."""
        last = self.speed.last_at if self.speed is not None else None
        typical = self.speed.step_s if self.speed is not None else None
        if last is None:
            return None
        last = max(last, self._served_at)
        if self._slow_since is not None and last > self._slow_since:  # a step committed
            self.history.record(
                self.job_id,
                "resume",
                f"steps commit again (step {step}) after {last - self._slow_since:.0f} s",
            )
            self._slow_since = None
        threshold = max(SLOW_STALL_MIN_S, SLOW_STALL_STEPS * (typical or 0.0))
        if now - last < threshold:
            return None
        where = self.progress()
        if self._slow_since is None:
            self._slow_since = last
            self.history.record(
                self.job_id,
                "stall",
                f"no step committed for {now - last:.0f} s at step {step}: {where}",
            )
        at = time.strftime("%H:%M:%S", time.localtime(last))
        usual = f" (a step took about {typical:.1f} s)" if typical else ""
        return (
            f"stalled at step {step}: no step committed since {at}{usual}; {where}. A hung "
            "replica is left out once its load reports stop (--load-silence-s) and its work "
            "replayed; a slow one is waited for: see the scheduler's log"
        )

    async def run(self, period_s: float = 1.0) -> None:
        """Look every `period_s` until cancelled."""
        while True:
            await self.look()
            await asyncio.sleep(period_s)
