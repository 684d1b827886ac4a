"""What a running job waits for, and what the operator can do about it.

While a job trains, `StallWatch` looks every second at who serves each stage. A stage without a
replica stalls the job (no microbatch can cross it): its state is `stalled` until the stage is
served again (then `running`), and its message says which stage, since when, what is done about
it and what will happen then (every stage rolls back to the last checkpoint, so many steps are
trained again); the job waits "since" the moment the stage emptied, which `swarm status` counts
up. What is done is the scheduler's own remedy when it has one: the watch asks `refill` (the
job's `scheduler.rebalance_loop.Mover`) at once, which sends an idle peer or a spare replica of
another stage; a stage whose replicas were all reached through a relay that is gone (`lost`: the
registry's `lost_relays`) names that relay and what brings one back, since a stage server more
would be cut off the same way; only a stage with neither says "start a stage server" (said once
for all the stages it applies to). A stage with fewer
replicas than the job's `min_replicas` (with the default 1: a single replica) is a warning that
names the servers it takes: losing a single replica costs the steps since the last checkpoint,
where a spare would have taken over without loss. So is a stage whose replicas all run on one
machine, or sit behind one router (their failure domains, `swarm.policy.domains.crowded`): placement
spreads them where it can, and this says where it could not. Each change is an event in the job's
history.

Steps that stop committing while every stage is served stall the job too (`stalled`, issue 63):
after 20 usual step times (at least a minute), or the job's `runtime.patience_s` if that is
shorter. Its message names the last failure its trainer saw (a stage that refuses every call,
with the refusal's code and text, `swarm.rpc.causes`), and the job goes back to `running` by
itself once a step commits: nothing retries silently forever.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from scheduler.history import History
from scheduler.logged import logged
from scheduler.speed import RecentSpeed
from scheduler.stall_words import (
    REMEDY,
    crowded_text,
    lost_stage_text,
    relay_down_text,
    single_replica_text,
    under_replicated_text,
)
from swarm.job.states import JobState
from swarm.policy.domains import Domains, crowded
from swarm.rpc.lease import Replica

__all__ = ["Health", "StallWatch"]

log = logging.getLogger(__name__)

# Steps that stop committing for this many usual step times (and at least this long) while every
# stage is served are a stall too (a hung or very slow replica, trainers gone).
SLOW_STALL_STEPS = 20
SLOW_STALL_MIN_S = 60.0
# How often the last checkpoint's step is read from disk while no step commits (messages name it).
CHECKPOINT_LOOK_S = 10.0


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
        say: Callable[[str, JobState | None], Awaitable[None]],
        said: Callable[[], str],
        history: History,
        health: Health,
        clock: Callable[[], float] = time.time,
        speed: RecentSpeed | None = None,
        progress: Callable[[], str] = lambda: "",
        refill: Callable[[list[int]], Awaitable[dict[int, str]]] | None = None,
        min_replicas: int = 1,
        counted: Callable[[], list[list[Replica]]] | None = None,
        barred: Callable[[list[int]], dict[int, list[str]]] | None = None,
        lost: Callable[[list[int]], dict[int, str]] | None = None,
        refused: Callable[[], Mapping[int, str]] = dict,
        domains: Callable[[], Mapping[str, Domains]] | None = None,
        cause: Callable[[], str | None] = lambda: None,
        patience_s: float = math.inf,
    ) -> None:
        """`members()`: who serves each stage now; `step()`: the job's committed steps;
        `checkpoint()`: the step the last sealed checkpoint holds (0: none); `say(text, state)`:
        set the job's message (and its state, unless None), `said()`: what it is now; `health`:
        what this watch keeps current; `speed`: the job's commits (a job served everywhere whose
        steps stop is stalled too), `progress()`: where its open step is, in words;
        `refill(stages)`: send spares to stages nobody serves, saying what it did for each
        (`Mover.refill`); `min_replicas`: the job's, for its warnings; `counted()`: the replicas
        that count for the warnings, those whose join succeeded (default: `members()`);
        `lost(stages)`: of `stages`, those cut off by a relay that is gone, with that relay
        (`PeerRegistry.lost_relays`); `barred(stages)`: of `stages`, the servers still on them
        that are banned from the job (so no replica), by stage; `refused()`: of the stages
        nobody serves, those whose peer sent refused the job, with its words (`Mover.refused`).
        `domains()`: the peers' failure domains (None: not known, no warning of them).
        `cause()`: why the job's last microbatch failed, if none went through since (its
        trainer's `failure`); `patience_s`: the job's `runtime.patience_s`, the longest a job
        whose steps stopped waits before its state is `stalled` (named with that cause)."""
        self.job_id, self.members, self.step, self.checkpoint = job_id, members, step, checkpoint
        self.say, self.said, self.history = say, said, history
        self.health, self.clock = health, clock
        self.speed, self.progress = speed, progress
        self.refill, self.min_replicas = refill, min_replicas
        self._plans: dict[int, str] = {}  # what is done for each stage nobody serves
        self._relays: dict[int, str] = {}  # the relay gone that cut off each stage nobody serves
        self._refused: dict[int, str] = {}  # the refusal said for each stage nobody serves
        self._stalled = False  # the job's state is "stalled" (set by this watch)
        self.counted = counted or members
        self.barred, self.refused = barred, refused
        self.lost = lost or (lambda stages: {})
        self._slow_since: float | None = None  # the last commit, while no step commits
        self._served_at = -math.inf  # when a lost stage was last served again
        # (when read, the job's step then, the checkpoint's step read)
        self._checkpoint_at: tuple[float, int, int] | None = None
        self._lost: dict[int, float] = {}  # stage -> when it was last seen with no replica
        self._single: set[int] = set()  # stages warned about
        self.domains = domains
        self._crowded: set[str] = set()  # crowded-domain warnings said as events
        self._routers: dict[int, list[tuple[str, str]]] = {}  # stage -> (peer, router) served
        self._said = ""
        self.cause, self.patience_s = cause, patience_s
        self._started = clock()  # the baseline of a job that never committed a step

    async def look(self) -> None:
        """Take in who serves each stage now; say what changed."""
        members, now = self.members(), self.clock()
        step = self.step()
        checkpoint = self._checkpoint(now, step)
        missing = [k for k, replicas in enumerate(members) if not replicas]
        plans: dict[int, str] = {}
        if (missing or self._lost) and self.refill is not None:
            # A move publishes on the bus: a failure there is logged and tried again next look,
            # never the end of the watch (and the job's training attempt with it). Asked too at
            # the look a stage is served again: what it keeps of that stage is let go then.
            with logged(log, f"job {self.job_id}: refill failed"):
                plans = await self.refill(missing)
        relays = self.lost(missing) if missing else {}
        homes = self._homes(members, missing, relays)
        bans = self.barred(missing) if missing and self.barred is not None else {}
        refused = {k: why for k, why in self.refused().items() if k in missing}
        for k in missing:
            what = plans.get(k)
            down, source = (None, "") if what else _down(k, relays, homes, bans, refused)
            if k not in self._lost:
                self._lost[k] = now
                self.history.record(
                    self.job_id,
                    "stall",
                    f"stage {k} lost its last replica at step {step}: training stalled; "
                    + (what or down or REMEDY),
                )
            elif what and self._plans.get(k) != what:  # a spare came later
                self.history.record(self.job_id, "move", f"stage {k} has no replica: {what}")
            elif (source == "relay" and self._relays.get(k) != relays[k]) or (
                source == "refused" and self._refused.get(k) != refused[k]
            ):  # its relay's loss, or the refusal of the peer sent to it, known later
                self.history.record(self.job_id, "stall", f"stage {k} has no replica: {down}")
        self._plans, self._relays, self._refused = plans, relays, refused
        served_again = ""
        for k in [k for k in self._lost if k not in missing]:
            held = now - self._lost.pop(k)
            who = ", ".join(r.peer for r in members[k])
            self._served_at = now  # its rollback comes next: not a slow step
            served_again = f"stage {k} is served again ({who}) after {held:.0f} s without a replica"
            self.history.record(self.job_id, "resume", served_again)
        self._warn(self.counted(), checkpoint)  # a replica still joining is no spare yet
        # Served again (or steps commit again): running, said with whatever is said next, or
        # with what it says now. Steps that stopped are `stalled` too, with their cause.
        back: JobState | None = "running" if self._stalled and not missing else None
        slow = self._slow(now, step) if not missing else None
        if slow is not None:
            self.health.waiting_since = self._slow_since or now
            if slow != self._said or not self._stalled:
                self._said = slow
                await self.say(slow, None if self._stalled else "stalled")
        elif missing:
            since = min(self._lost.values())
            self.health.waiting_since = since
            text = lost_stage_text(
                missing, step, checkpoint, since, plans, relays, homes, bans, refused
            )
            if text != self._said or not self._stalled:
                self._said = text
                await self.say(text, None if self._stalled else "stalled")
        else:
            self.health.waiting_since = 0.0
            # The stall's message, unless something (a rollback) has said more since.
            if self._said and self.said() == self._said:
                await self.say(f"training: {served_again}" if served_again else "training", back)
            elif back:
                await self.say(self.said(), back)
            self._said = ""
        self._stalled = bool(missing) or slow is not None

    def _homes(
        self, members: list[list[Replica]], missing: list[int], relays: dict[int, str]
    ) -> dict[int, tuple[str, list[str]]]:
        """Of `missing` (not cut off by a relay's loss), the stages whose replicas all sat behind
        one router when last served: that router, and those replicas. Remembered while served:
        a peer gone is no longer in the registry's domains."""
        if self.domains is None:
            return {}
        if len(missing) < len(members):
            known = self.domains()
            for k, replicas in enumerate(members):
                if replicas:
                    self._routers[k] = [
                        (r.peer, d.router if (d := known.get(r.peer)) else "") for r in replicas
                    ]
        homes = {}
        for k in missing:
            served = self._routers.get(k, [])
            routers = {router for _, router in served}
            if k not in relays and len(routers) == 1 and "" not in routers:
                homes[k] = (routers.pop(), [peer for peer, _ in served])
        return homes

    def _warn(self, members: list[list[Replica]], checkpoint: int) -> None:
        """Keep the warnings current: stages short of `min_replicas` (with 1: a single replica),
        each said once as an event as it starts."""
        sizes = [len(replicas) for replicas in members]
        peers = [[r.peer for r in replicas] for replicas in members]
        floor = max(2, self.min_replicas)  # with min_replicas 1, a single replica is the risk
        single = {k for k, n in enumerate(sizes) if 0 < n < floor}
        if self.min_replicas > 1:
            short = [n if n else floor for n in sizes]  # an empty stage is the stall's message
            warnings = [under_replicated_text(short, floor, peers, checkpoint)] if single else []
            if single - self._single:
                self.history.record(self.job_id, "warning", warnings[0])
        else:
            ones = sorted(single)
            warnings = (
                [single_replica_text(ones, [peers[k][0] for k in ones], checkpoint)] if ones else []
            )
            if single - self._single:  # said once as it starts, for the stages new to it
                new = sorted(single - self._single)
                text = single_replica_text(new, [peers[k][0] for k in new], checkpoint)
                self.history.record(self.job_id, "warning", text)
        self._single = single
        self.health.warnings = warnings + self._crowded_warnings(peers)

    def _crowded_warnings(self, peers: list[list[str]]) -> list[str]:
        """Stages whose replicas all share a host, or a router; each said as an event when it
        starts."""
        if self.domains is None:
            return []
        texts = [
            crowded_text(k, kind, domain, peers[k])
            for k, kind, domain in crowded(peers, self.domains())
        ]
        for text in sorted(set(texts) - self._crowded):
            self.history.record(self.job_id, "warning", text)
        self._crowded = set(texts)
        return texts

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
        cause = self.cause()
        if last is None and cause is None:  # not one step yet, and nothing failed: starting
            return None
        last = max(last if last is not None else self._started, self._served_at)
        if self._slow_since is not None and last > self._slow_since:  # a step committed
            self.history.record(
                self.job_id,
                "resume",
                f"steps commit again (step {step}) after {last - self._slow_since:.0f} s",
            )
            self._slow_since = None
        threshold = max(SLOW_STALL_MIN_S, SLOW_STALL_STEPS * (typical or 0.0))
        if now - last < min(threshold, self.patience_s):
            return None
        where = self.progress()
        why = f"the last failure: {cause}; " if cause else ""
        if self._slow_since is None:
            self._slow_since = last
            self.history.record(
                self.job_id,
                "stall",
                f"no step committed for {now - last:.0f} s at step {step}: {why}{where}",
            )
        at = time.strftime("%H:%M:%S", time.localtime(last))
        usual = f" (a step took about {typical:.1f} s)" if typical else ""
        if cause:
            return (
                f"stalled at step {step}: cannot progress, no step committed since {at}{usual}; "
                f"{why}{where}. Training carries on by itself once the cause clears"
            )
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


def _down(
    k: int,
    relays: dict[int, str],
    homes: dict[int, tuple[str, list[str]]],
    bans: dict[int, list[str]],
    refused: Mapping[int, str],
) -> tuple[str | None, str]:
    """Why stage `k`, which nobody serves and the scheduler sends nobody to, is down, in words,
    and which of those it is ("relay", "home", "banned", "refused"); (None, "") when none is
    known (the remedy is `REMEDY`)."""
    if k in relays:
        return relay_down_text(relays[k]), "relay"
    if k in homes:
        return (
            f"its replicas ({', '.join(homes[k][1])}) all sat behind router {homes[k][0]}",
            "home",
        )
    if bans.get(k):
        return f"its server(s) {', '.join(bans[k])} banned from this job; {REMEDY}", "banned"
    if refused.get(k):
        return f"{refused[k]}; {REMEDY}", "refused"
    return None, ""
