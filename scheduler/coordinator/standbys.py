"""Standbys (issue 67): peers of a stage that follow its committed updates without serving, so
that a stage lost whole (one home's outage takes every replica of a small pool) goes on from the
step it was at instead of rolling every stage back to the last checkpoint.

A standby is a peer the scheduler placed on the stage that the coordinator keeps out of its
members: it copies a member and follows its updates as a joiner does (`Membership._join`, the
follow ticket its Join brings), asked again as each step opens so that it holds the step's state
within a step's opening, but never admitted while the stage has a member. Trainers see only
members, so it serves nothing. When every replica of its stage is gone, the coordinator's
re-admission before a rollback (`Membership.readmit`) finds it answering at the job's step and
makes it the stage's replica (its Discard is the scheduler's signed call, as a Join is): the
job's history says "promoted", and nothing rolls back. A standby behind the step missed updates
that died with the stage: the job rolls back as before, and the rollback says why (`missed`).

Which peers: each stage keeps `wanted` of them, chosen at a step boundary (no step of the
stage's is open, so a replica turned standby holds no work) among the stage's peers, never one
that would leave the stage without a replica, never one on the host of a replica it stands by
for. A spare first (`swarm.policy.spares`: a peer the job does not need to serve, by
rebalancing's notion of need, so it costs the job nothing), then, only where the job asked for
standbys by number (not `only_spares`, the default's "where the swarm has room"), a replica it
needs; within each, a joiner (which serves nothing yet) before a replica, standbys of one stage
spread over hosts, the slowest first. Under `only_spares` a standby the job has come to need
(its stage became the bottleneck: a replica left) serves again (`released`).

A standby is judged by the step its copy of the stage is at, from the step it is chosen, as each
step opens (`opened`), whether its asks answer or not. One that falls behind (more than
`LAG_BOUND` steps behind as `LAG_STEPS` steps in a row open, or `FAILED_ASKS` asks in a row
failed), or that holds no copy as `COPY_STEPS` steps in a row open (its first copy does not
finish, or it does not answer at all: the soak's standby stopped and resumed at an old step,
whose copy never loaded, was kept until its stage was lost), is replaced: it becomes an
ordinary peer of its stage (it joins when it catches up, as any joiner), is not chosen again,
and another candidate stands by from the next boundary. It never slows the pool meanwhile:
its asks run in the background (`nudge`). The job's history says each of these with its
cause (`said`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from swarm.errors import SwarmError
from swarm.policy.spares import bottleneck, spare
from swarm.rpc.causes import brief
from swarm.rpc.lease import Replica

__all__ = ["COPY_STEPS", "FAILED_ASKS", "LAG_BOUND", "LAG_STEPS", "Standbys"]

log = logging.getLogger(__name__)

#: Told (step, stage, peer) when a standby becomes its stage's replica.
Promoted = Callable[[int, int, str], None]
#: Told (stage, peer, the words for the job's history) when a standby is replaced or released.
Said = Callable[[int, str, str], None]

#: A standby more than this many steps behind as a step opens is behind ...
LAG_BOUND = 2
#: ... and replaced once that held as this many steps in a row opened.
LAG_STEPS = 3
#: A standby whose asks (its Join as a step opens) failed this many times in a row is replaced.
FAILED_ASKS = 3
#: A standby that holds no copy of its stage's state (its first copy, or a peer that never
#: answers its Join) as this many steps in a row open is replaced. A copy is about three
#: steps' updates (the parameters and the optimizer's moments), so a link that keeps up with
#: the updates copies within a few steps; the rest is room for a source busy serving others
#: (`--max-state-downloads`). Not unbounded: a standby holding nothing saves no stage.
COPY_STEPS = 20
#: A standby lost stands by again only this long after (seconds): a peer restarted after a
#: crash may hold the state again, but one flipping its announcement stands by once, not on
#: every flip (N9).
LOST_COOLDOWN_S = 60.0


class Standbys:
    def __init__(
        self,
        wanted: int = 0,
        host: Callable[[str], str] = lambda peer: peer,
        *,
        only_spares: bool = False,
        min_replicas: int = 1,
        router: Callable[[str], str] = lambda peer: "",
        vouched: Callable[[str], bool] = lambda peer: True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`wanted`: standbys per stage (the job's `runtime.standby`; 0: none); `host(peer)`:
        the machine a peer runs on (its failure domain), never a replica's of its stage;
        `only_spares`: only peers the job does not need stand by (`runtime.standby = "auto"`),
        else a replica it needs may when no spare can; `min_replicas`: the job's floor, which
        no standby takes a stage below (`swarm.policy.spares`); `router(peer)`: the public
        address its traffic leaves from ("" not known): one none of the stage's replicas is
        behind first, as one home's outage takes its router's peers together; `vouched(peer)`:
        whether the scheduler placed `peer` on the job or its coordinator admitted it: no other
        stands by (a peer that only says it serves the stage is given no state, N9)."""
        self.wanted, self.host, self.router, self.vouched = wanted, host, router, vouched
        self.clock = clock
        self.only_spares, self.min_replicas = only_spares, min_replicas
        self._stage: dict[str, int] = {}  # standby -> the stage it stands by for
        self._at: dict[str, int] = {}  # standby -> the step its last Join answered (-1: copying)
        self.promoted: list[Promoted] = []
        self.said: list[Said] = []
        # Why the last stage lost whole had no standby to promote ("" none): the rollback's words.
        self.missed = ""
        self._asks: dict[str, asyncio.Task[None]] = {}  # standby -> its Join asked as a step opened
        self._behind: dict[str, int] = {}  # standby -> steps in a row it opened > LAG_BOUND behind
        self._failed: dict[str, int] = {}  # standby -> its asks in a row that failed
        self._none: dict[str, int] = {}  # standby -> steps in a row it opened holding no copy
        self._judged: dict[str, int] = {}  # standby -> the last step it was judged at
        # Peers replaced for falling behind, with why: never chosen again while on their stage.
        self.passed_over: dict[str, str] = {}
        # Standbys lost (gone from their stage's list) -> when: none stands by again within
        # LOST_COOLDOWN_S (one flipping its announcement would, and be said to, on every flip).
        self.lost: dict[str, float] = {}
        self.short: list[int] = []  # stages short of `wanted` after the last boundary's choice

    def peers(self) -> set[str]:
        """The standbys now, of every stage."""
        return set(self._stage)

    def of(self, peer: str) -> int | None:
        """The stage `peer` stands by for (None: it is no standby)."""
        return self._stage.get(peer)

    def choose(self, members: list[list[Replica]], synced: set[str]) -> list[str]:
        """At a step boundary: forget the standbys no longer listed on their stage, and give each
        stage short of `wanted` more. Returns the members (of `synced`) made standbys: they leave
        the members before the next step opens, and copy and follow one of them from then on."""
        if not self.wanted and not self._stage:
            return []
        listed = {r.peer: k for k, stage in enumerate(members) for r in stage}
        self.passed_over = {p: why for p, why in self.passed_over.items() if p in listed}
        for peer, k in list(self._stage.items()):
            if listed.get(peer) != k:
                log.info(
                    "standby %s of stage %d is gone (stands by again %.0f s on)",
                    peer,
                    k,
                    LOST_COOLDOWN_S,
                )
                self._forget(peer)
                self.lost[peer] = self.clock()
        # A rollback loads its checkpoint on every peer listed, standbys too, which makes them
        # members: they stand by again where a replica on another host stays; one that is its
        # stage's only replica now (the others died with the rollback's cause) stays its replica.
        demoted = []
        for peer, k in list(self._stage.items()):
            if peer not in synced:
                continue
            left = {self.host(r.peer) for r in members[k] if r.peer in synced - self._stage.keys()}
            if left and self.host(peer) not in left:
                demoted.append(peer)
            else:
                log.info("standby %s is stage %d's replica now (a rollback loaded it)", peer, k)
                self._forget(peer)
        self._apart(members, synced)
        speeds = [{r.peer: r.throughput for r in stage} for stage in members]
        if self.only_spares:
            self._release(speeds)
        for k, stage in enumerate(members):
            while sum(s == k for s in self._stage.values()) < self.wanted:
                picked = self._pick(k, stage, synced, speeds)
                if picked is None:
                    break
                self._stage[picked.peer] = k
                log.info(
                    "stage %d: %s stands by (follows its updates, serves nothing)", k, picked.peer
                )
                if picked.peer in synced:
                    demoted.append(picked.peer)
        # Stages left short: none of their own peers may stand by; a spare of another stage
        # may be moved there (`scheduler.rebalance_loop.Mover.stand_by`).
        self.short = [
            k
            for k in range(len(members))
            if sum(s == k for s in self._stage.values()) < self.wanted
        ]
        return [p for p in demoted if p in self._stage]

    def _apart(self, members: list[list[Replica]], synced: set[str]) -> None:
        """Replace each standby whose host now holds every replica of its stage (one joined
        there, the others left): it was chosen on another host, and one outage of this one
        would take the stage and its standby together."""
        for peer, k in list(self._stage.items()):
            if peer in synced:
                continue
            hosts = {self.host(r.peer) for r in members[k] if r.peer in synced - self._stage.keys()}
            if hosts == {self.host(peer)}:
                self._replace(
                    peer, f"its host {self.host(peer)} now holds every replica of the stage"
                )

    def _pick(
        self, stage: int, listed: list[Replica], synced: set[str], speeds: list[dict[str, float]]
    ) -> Replica | None:
        """The peer of `stage` (`listed`) to make its next standby, None when none may be."""
        replicas = [r for r in listed if r.peer in synced and r.peer not in self._stage]
        held = {self.host(p) for p, k in self._stage.items() if k == stage}
        fits = []
        for c in listed:
            if c.peer in self._stage or c.peer in self.passed_over or self._cooling(c.peer):
                continue
            if not self.vouched(c.peer):
                continue
            left = {self.host(r.peer) for r in replicas if r.peer != c.peer}
            if left and self.host(c.peer) not in left:  # a replica stays, on another host
                free = spare(speeds, {*self._stage, c.peer}, self.min_replicas)
                routers = {self.router(r.peer) for r in replicas if r.peer != c.peer} - {""}
                fits.append((c, free, self.router(c.peer) in routers))
        if self.only_spares:
            fits = [f for f in fits if f[1]]
        # A spare first, a joiner first, a router none of the stage's replicas is behind
        # first, a host no standby of the stage is on first, the slowest replica first.
        fits.sort(
            key=lambda f: (
                not f[1],
                f[0].peer in synced,
                f[2],
                self.host(f[0].peer) in held,
                f[0].throughput,
                f[0].peer,
            )
        )
        return fits[0][0] if fits else None

    def _cooling(self, peer: str) -> bool:
        """Whether `peer`, lost as a standby, was lost within `LOST_COOLDOWN_S`."""
        lost = self.lost.get(peer)
        return lost is not None and self.clock() - lost < LOST_COOLDOWN_S

    def _release(self, speeds: list[dict[str, float]]) -> None:
        """Under `only_spares`: standbys the job needs now (their stage fell to the bottleneck,
        a replica left) serve again, the one whose return lifts the bottleneck most first."""
        out = set(self._stage)
        while out and not spare(speeds, out, self.min_replicas):
            back = max(sorted(out), key=lambda p: bottleneck(speeds, out - {p}))
            out.discard(back)
            stage = self._stage[back]
            self._forget(back)
            self._say(
                stage,
                back,
                f"standby {back} of stage {stage} serves again: the job needs it as a replica "
                "(without it the slowest stage is slower); a spare stands by when there is one",
            )

    def _forget(self, peer: str) -> None:
        self._stage.pop(peer, None)
        self._at.pop(peer, None)
        self._behind.pop(peer, None)
        self._failed.pop(peer, None)
        self._none.pop(peer, None)
        self._judged.pop(peer, None)

    def _say(self, stage: int, peer: str, text: str) -> None:
        log.warning("%s", text)
        for told in self.said:
            told(stage, peer, text)

    def _replace(self, peer: str, why: str) -> None:
        """`peer` fell behind (`why`): an ordinary peer of its stage from now on, never chosen
        again; another stands by from the next boundary, if one may."""
        stage = self._stage[peer]
        self._forget(peer)
        self.passed_over[peer] = why
        asking = self._asks.pop(peer, None)
        if asking is not None:
            asking.cancel()
        self._say(
            stage,
            peer,
            f"standby {peer} of stage {stage} replaced: {why}; another peer of the stage stands "
            "by from the next step, if one may",
        )

    def nudge(self, peer: Replica, join: Coroutine[Any, Any, int], step: int) -> bool:
        """As `step` opens: ask the standby `peer` (its Join, `join`, which fetches the step's
        update at once) in the background, one ask at a time; the pool never waits for a standby,
        however slow its link, nor for one replaced (`passed_over`: its own loop admits it once
        it caught up). A standby behind by more than `LAG_BOUND` as `LAG_STEPS` steps in a row
        open is replaced. False (`join` left to the caller) for any other peer."""
        if peer.peer not in self._stage and peer.peer not in self.passed_over:
            return False
        if peer.peer in self._stage and self._judged.get(peer.peer) != step:
            self._judge(peer.peer, step)
        asking = self._asks.get(peer.peer)
        if asking is not None and not asking.done():
            join.close()  # the one before is still on its way: this one is not sent
            return True
        self._asks[peer.peer] = asyncio.ensure_future(self._ask(peer.peer, join))
        return True

    def opened(self, step: int) -> None:
        """As `step` opens, after the asks (`nudge`): judge every standby not judged at it, one
        whose Join does not answer (not asked as a copy, its own loop backing off) as well."""
        for peer in list(self._stage):
            if self._judged.get(peer) != step:
                self._judge(peer, step)

    def _judge(self, peer: str, step: int) -> None:
        """`peer`'s standing as `step` opens, once a step: by the step its copy is at (`lag`),
        holding none counted too; replaced when either stays out of its bound."""
        self._judged[peer] = step
        lag = self.lag(peer, step)
        none = self._in_a_row(self._none, peer, lag is None)
        behind = self._in_a_row(self._behind, peer, lag is not None and lag > LAG_BOUND)
        if none >= COPY_STEPS:
            self._replace(
                peer,
                f"it held no copy of the stage's state as {none} steps in a row opened "
                f"(to step {step}): its copy does not finish, or it does not answer",
            )
        elif behind >= LAG_STEPS:
            self._replace(
                peer,
                f"it was more than {LAG_BOUND} steps behind as {behind} steps in a row "
                f"opened ({lag} at step {step}): its link does not keep up with the updates",
            )

    @staticmethod
    def _in_a_row(counts: dict[str, int], peer: str, now: bool) -> int:
        """`peer`'s steps in a row in `counts`: one more if `now`, else none (forgotten)."""
        if not now:
            counts.pop(peer, None)
            return 0
        counts[peer] = counts.get(peer, 0) + 1
        return counts[peer]

    async def _ask(self, peer: str, join: Coroutine[Any, Any, int]) -> None:
        try:
            at = await join
        except Exception as e:  # its own loop asks again; a standby gone is forgotten
            if isinstance(e, SwarmError):
                log.info("standby %s did not answer its Join: %s", peer, e)
            else:  # nobody reads this task's outcome: said here, or never
                log.warning("standby %s: its Join failed: %r", peer, e, exc_info=e)
            if peer not in self._stage:
                return
            self._failed[peer] = failed = self._failed.get(peer, 0) + 1
            if failed >= FAILED_ASKS:
                self._asks.pop(peer, None)  # this ask, ending: nothing to cancel
                self._replace(
                    peer, f"its last {failed} asks for the stage's updates failed ({brief(e)})"
                )
            return
        self._failed.pop(peer, None)
        self.answered(peer, at)

    def asking(self) -> list[asyncio.Task[None]]:
        """The asks in flight, cancelled (the coordinator closes)."""
        for task in self._asks.values():
            task.cancel()
        return list(self._asks.values())

    def answered(self, peer: str, at: int) -> None:
        """`peer`'s Join said it is a copy at `at` (-1: still copying). One that held a copy
        and copies again (its follow failed: it fell out of its source's update log) is still
        at the step it held, and falls behind from there."""
        if peer in self._stage and (at >= 0 or self._at.get(peer, -1) < 0):
            self._at[peer] = at

    def rolled_back(self) -> None:
        """A rollback loaded another state: what each standby held is of the trajectory rolled
        back, so none holds a copy until its Join says so again (its last copy's step kept read
        "0 steps behind", and the bound on a standby holding no copy never applied)."""
        for peer in self._stage:
            self._at[peer] = -1
            self._behind.pop(peer, None)
            self._none.pop(peer, None)

    def lag(self, peer: str, step: int) -> int | None:
        """How many steps `peer` is behind `step` (None: it holds no copy yet)."""
        at = self._at.get(peer, -1)
        return None if at < 0 else max(0, step - at)

    def words(self, peer: str, step: int, source: str) -> str:
        """What `swarm status` says of the standby `peer` at the coordinator's `step`, or of one
        replaced until it joins; "" for any other peer."""
        if peer in self.passed_over:
            return f"replaced as standby ({self.passed_over[peer]}); joins once it caught up"
        if peer not in self._stage:
            return ""
        lag, stage = self.lag(peer, step), self._stage.get(peer)
        if lag is None:
            none = self._none.get(peer, 0)
            if not none:  # chosen at this boundary: no step judged it yet
                return f"standby for stage {stage}: copying the state of {source or 'a member'}"
            steps = "step" if none == 1 else "steps"
            return (
                f"standby for stage {stage}: holds no copy yet as {none} {steps} opened "
                f"(copying the state of {source or 'a member'}; replaced at {COPY_STEPS})"
            )
        steps = "step" if lag == 1 else "steps"
        return f"standby for stage {stage}, {lag} {steps} behind (following {source or 'a member'})"

    def promote(self, step: int, stage: int, peer: str) -> bool:
        """`peer`, answering at the job's `step` on `stage` that lost every replica, is its replica
        now: whether it was a standby (those told of it then)."""
        if self._stage.pop(peer, None) is None:
            return False
        self._at.pop(peer, None)
        self.missed = ""
        for told in self.promoted:
            told(step, stage, peer)
        return True

    def explain(self, lost: list[int], step: int, answered: Mapping[str, int]) -> None:
        """`lost` stages have no replica at `step` after the re-admission; `answered`: the step
        each peer looked at answered at (-1: it did not answer). Kept in `missed`."""
        if not self.wanted:
            return
        said = []
        for k in lost:
            mine = [p for p, s in self._stage.items() if s == k]
            alive = [p for p in mine if answered.get(p, -1) >= 0]
            if not alive:
                gone = f" (its standby {', '.join(mine)} was lost with it)" if mine else ""
                said.append(f"stage {k} had no standby{gone}")
                continue
            for p in alive:
                said.append(
                    f"stage {k}'s standby {p} was at step {answered[p]}, not {step}: the updates "
                    "it lacked were lost with the stage"
                )
        self.missed = "; ".join(said)
