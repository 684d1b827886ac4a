"""Which replicas are members: those known to be at the coordinator's step. Trainers see and use
only members; a replica that is new, restarted or moved copies a member of its stage in the
background (`sync` starts it at a step boundary, training goes on) and becomes one when it is a
copy at the open step; one that stops answering is dropped until then. Until it is a member a
replica does not count (status shows it joining, with what it waits for: `waits`).

A joiner is told the coordinator's rollback epoch with each Join (`swarm.rpc.epoch`): one that
joins after a rollback got none of its LoadStates, and would take work leased before it. It is
admitted only on the answer to a Join that said the epoch current then: one answered across a
rollback is asked again, with the new one. A peer new to the job starts joining within its
stage's entry rate (`entry`). A standby (`standbys`) copies and follows as a joiner does, but
is made a member only when its stage lost every replica (`readmit`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable

from scheduler.coordinator.discards import Discards
from scheduler.coordinator.entry import Entry
from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.metrics import CoordinatorMetrics
from scheduler.coordinator.replicas import GONE, ReplicaClients
from scheduler.coordinator.standbys import Standbys
from scheduler.coordinator.unlisted import Unlisted
from swarm.clock import Clock
from swarm.errors import SwarmError
from swarm.ops.rated import RatedLog
from swarm.policy.backoff import Backoff, Backoffs
from swarm.rpc.causes import brief
from swarm.rpc.lease import Replica

__all__ = ["Membership", "restarted"]

log = logging.getLogger(__name__)

#: A replica is a member of the job only once its join succeeded; until then it is whatever a
#: peer says of itself, and may come and go as often as it likes: what its joins say in the log
#: is rated per peer (once per this many seconds, the next line says how many were held back).
JOIN_LOG_EVERY_S = 10.0


class Membership:
    _JOIN_FIRST_S, _JOIN_CAP_S = 0.5, 30.0  # pause before retrying a joiner that is absent
    _ASK_FIRST_S, _ASK_CAP_S = 0.02, 2.0  # pauses between asks of a joiner still copying

    def __init__(
        self,
        job_id: str,
        members: Callable[[], list[list[Replica]]],
        clients: ReplicaClients,
        ledgers: Callable[[], list[StepLedger]],
        metrics: CoordinatorMetrics,
        clock: Clock,
        can_admit: Callable[[int], bool] = lambda step: True,
        on_admit: Callable[[], None] = lambda: None,
        grad_clip: float = 0.0,
        on_joined: Callable[[int, int, str, str], None] = lambda step, stage, peer, source: None,
        known: Callable[[str], bool] | None = None,
    ) -> None:
        """`can_admit(step)`: whether a replica at `step` may become a member now (the step is
        open and no commit or rollback is under way); `on_admit()`: one did. `grad_clip`: the
        job's (a half-applied step is finished with the coefficient it was applied with).
        `ledgers()`: those of the steps not yet applied, oldest first (two with
        delayed_update); members are at the oldest one's step. `known(peer)`: the job had `peer`
        as a member; the others, new to it, start joining within their stage's entry rate
        (`entry`; None: every peer is known)."""
        self.job_id, self.members, self.clients = job_id, members, clients
        self.grad_clip = grad_clip
        self.can_admit, self.on_admit = can_admit, on_admit
        self.on_joined = on_joined  # (step, stage, peer, the member it copied): the route record
        self.entry = Entry(clock, known or (lambda peer: True))
        # The rollback epoch the coordinator leases in now, said to each joiner (`Rollback`
        # sets it: its `leasing`).
        self.epoch: Callable[[], int] = lambda: 0
        # The epoch of the last rollback's LoadStates (0: none yet): a replica at an older one
        # missed it, and holds the state from before it (`readmit` leaves it out).
        self.rolled_back = 0
        self._sources: dict[str, str] = {}  # joiner -> the peer of the member it copies
        self._joining: dict[str, asyncio.Task[None]] = {}  # peer -> its join in the background
        # peer -> (stage, the joiner, the member it copies), once asked to copy it
        self._copying: dict[str, tuple[int, Replica, Replica]] = {}
        self.ledgers, self.metrics = ledgers, metrics
        self.synced: set[str] = set()
        # Former members left out (gone, silent or not answering) and not members again yet:
        # one back at the step it left at still holds its stage's state (`readmit`).
        self._left: set[str] = set()
        # stage -> "peer at address: error" of each member that did not answer the last reconcile
        self.unanswered: dict[int, list[str]] = {}
        self._stage_of: dict[str, int] = {}  # where each peer served when last seen
        self._joins = Backoffs(self._JOIN_FIRST_S, self._JOIN_CAP_S, clock)
        self.clock = clock
        # joiner -> (why its last Join failed, when it is tried again): until it answers
        self._failed: dict[str, tuple[str, float]] = {}
        self._refused: dict[str, str] = {}  # joiners whose last Join failed (or its copy): why
        self._copied: set[str] = set()  # joiners at the open step, waiting to be admitted
        # Told (step, stage, peer, the member it copied: "" for one re-admitted) whenever a
        # replica becomes a member: from then on it counts (the job's history says so).
        self.admitted: list[Callable[[int, int, str, str], None]] = []
        self._rated = RatedLog(log, every_s=JOIN_LOG_EVERY_S, clock=clock.now)
        self.standbys = Standbys()  # none unless the job asks (its coordinator's owner sets it)
        self.unlisted = Unlisted(clock.now)  # members the bus lost sight of, maybe alive
        self.discards = Discards(clients, metrics, ledgers)  # before one counts again

    def waits(self) -> dict[str, str]:
        """What each replica that serves its stage but is not a member yet waits for before it
        is one (and counts), in words: its join's progress as the coordinator sees it."""
        members, step = self.members(), next((ledger.step for ledger in self.ledgers()), 0)
        said: dict[str, str] = {}
        for stage, replicas in enumerate(members):
            sources = [r.peer for r in replicas if r.peer in self.synced]
            for r in replicas:
                if r.peer in self.synced:
                    continue
                failed = self._failed.get(r.peer)
                standby = self.standbys.words(r.peer, step, self._sources.get(r.peer, ""))
                if standby:  # a standby, or one replaced
                    said[r.peer] = standby
                elif r.peer in self.entry.held:
                    said[r.peer] = (
                        f"waiting its turn to enter stage {stage}: {self.entry.why(stage)}"
                    )
                elif r.peer in self._refused:  # before its copy: the copy begun again fails
                    said[r.peer] = (
                        f"its last Join failed ({self._refused[r.peer]}); asked again at the "
                        "next step's end"
                    )
                elif r.peer in self._copied:
                    said[r.peer] = (
                        "state copied; waiting for the step's commit (or the round's end) to "
                        "be admitted"
                    )
                elif r.peer in self._copying:
                    said[r.peer] = (
                        f"downloading state from {self._sources.get(r.peer) or 'a member'}"
                    )
                elif failed is not None:
                    again = max(0.0, failed[1] - self.clock.now())
                    when = f"in {again:.0f} s" if again >= 1 else "at the next step's end"
                    said[r.peer] = f"{failed[0]}; trying again {when}"
                elif not sources:
                    said[r.peer] = f"waiting for a member of stage {stage} to copy"
                else:
                    said[r.peer] = f"waiting for a step's end to download state from {sources[0]}"
        return said

    def replicas(self) -> list[list[Replica]]:
        """Per stage, the members at the coordinator's step."""
        members = self.members()
        for stage, replicas in enumerate(members):
            for r in replicas:
                before = self._stage_of.get(r.peer, stage)
                if before != stage:  # moved by rebalancing: a new replica of its new stage
                    log.info("%s moved from stage %d to %d", r.peer, before, stage)
                    self.synced.discard(r.peer)
                    for ledger in self.ledgers():  # what it held there is replayed
                        self.metrics.replays.inc(len(ledger.lose(r.peer, before)))
                self._stage_of[r.peer] = stage
        self.unlisted.listed(members, self.synced)
        return [[r for r in stage if r.peer in self.synced] for stage in members]

    def drop(self, peer: str, why: str) -> None:
        """A member gone, or left out for `why` (its cause, said in the log and in `waits`,
        which `swarm status` shows): no more work or rounds until it rejoins."""
        if peer in self.synced:
            log.warning("replica %s left out until it rejoins: %s", peer, why)
            self.synced.discard(peer)
            self._left.add(peer)
            self.unlisted.forget(peer)
            self._failed[peer] = (f"left out: {why}", self.clock.now())
            self.metrics.dropped.inc()
            for ledger in self.ledgers():
                self.metrics.replays.inc(len(ledger.lose(peer)))

    async def check(self, step: int) -> None:
        """Drop members that are gone or not at `step` (restarted empty at the same address)."""
        pairs = [(k, r) for k, stage in enumerate(self.replicas()) for r in stage]
        infos = await asyncio.gather(
            *(self.clients.get(k, r).info() for k, r in pairs), return_exceptions=True
        )
        for (_, r), info in zip(pairs, infos, strict=True):
            if isinstance(info, BaseException):
                self.drop(r.peer, f"its Info failed ({brief(info)})")
            elif info.step != step:
                self.drop(r.peer, restarted(info.step, step))

    async def readmit(self, step: int) -> bool:
        """Before a stage is declared lost: a replica that answers at `step` (the coordinator's)
        holds its stage's state, so it becomes a member (again): a replica left out for a missed
        deadline, or a standby (`standbys`: promoted). Its gradients of `step` are discarded
        (and replayed) first. Every replica of a stage with no member that may hold its state
        (`_held_it`: a former member, a standby of it, a joiner that copied a member) is looked
        at, and every former member elsewhere: a home outage leaves out a stage's only replica
        and one of another's, and the second must not be made to download the state it holds
        (a standby elsewhere is not: one is promoted only where its stage has no member). One whose
        state is of an epoch before the last rollback (Info's `state_epoch`) missed its
        LoadState: it is not re-admitted (the rollback loads it instead). A
        stage a former member no longer listed holds at `step` is not lost (`unlisted`): it
        waits for it, and its standby is not promoted, nor where a former replica is
        re-admitted. Nor is a stage lost whose holder's Discard got no answer (`discards`): it
        waits for the next try. Returns whether no stage is lost."""
        members, current = self.members(), self.replicas()
        # A former member of a stage that still has one is looked at, but never a standby
        # there, though it may have been a member before it stood by (the soak's peer3: killed
        # with its stage, back as its standby, and promoted when another stage was looked at).
        candidates = [
            (k, r)
            for k, stage in enumerate(members)
            for r in stage
            if r.peer not in self.synced
            and (
                (not current[k] and self._held_it(k, r.peer))
                or (r.peer in self._left and self.standbys.of(r.peer) is None)
            )
        ]
        # A former replica back at the step keeps its stage: its standby stands by on (looked
        # at last, and passed over where one was re-admitted).
        candidates.sort(key=lambda c: self.standbys.of(c[1].peer) is not None)
        held, infos = await asyncio.gather(
            self.unlisted.held(members, current, step, self._holds),
            asyncio.gather(
                *(self.clients.get(k, r).info() for k, r in candidates), return_exceptions=True
            ),
        )
        seen: dict[str, int] = {}  # the step each answered at: why a standby was not promoted
        waiting: set[int] = set()  # stages whose holder's Discard got no answer this try
        for (stage, r), info in zip(candidates, infos, strict=True):
            if isinstance(info, BaseException):
                log.info("stage %d: %s does not answer: %r", stage, r.peer, info)
                continue
            seen[r.peer] = info.step if (info.job, info.stage) == (self.job_id, stage) else -1
            if (info.job, info.stage, info.step) != (self.job_id, stage, step):
                continue  # restarted empty, or serving something else: it does not hold it
            if stage in held and self.standbys.of(r.peer) is not None:
                continue  # its replica holds the stage: the standby stands by on
            if info.state_epoch < self.rolled_back:
                log.warning(
                    "stage %d: %s answers at step %d but missed the last rollback: not re-admitted",
                    stage,
                    r.peer,
                    step,
                )
                continue
            discarded = await self.discards.discard(stage, r, step)
            if discarded is None:
                waiting.add(stage)  # not lost: the next try asks it again
                continue
            if not discarded:
                continue
            promoted = self.standbys.promote(step, stage, r.peer)  # a standby: its replica now
            how = "promoted from standby" if promoted else "re-admitted"
            log.warning("stage %d: %s answers at step %d: %s", stage, r.peer, step, how)
            self.synced.add(r.peer)
            self._left.discard(r.peer)
            self._failed.pop(r.peer, None)
            held.add(stage)
            for told in self.admitted:
                told(step, stage, r.peer, "")
        lost = [
            k
            for k, replicas in enumerate(self.replicas())
            if not replicas and k not in held | waiting
        ]
        self.standbys.explain(lost, step, seen)
        return not lost

    def _held_it(self, stage: int, peer: str) -> bool:
        """Whether `peer` may hold `stage`'s state as the coordinator made it: a former member,
        a standby of the stage, or a joiner whose copy of a member ended at the open step. Any
        other peer listed on the stage is a stranger to its state, whatever its Info says (a
        token holder's peer may announce any stage and answer Info at the job's step)."""
        return (
            peer in self._left
            or self.standbys.of(peer) == stage
            or (peer in self._copied and self._copying.get(peer, (stage,))[0] == stage)
        )

    async def _holds(self, stage: int, replica: Replica, step: int) -> bool:
        """Whether `replica` answers holding `stage`'s state at `step`, of the last rollback's
        epoch."""
        try:
            info = await self.clients.get(stage, replica).info()
        except SwarmError:
            return False
        at = (info.job, info.stage, info.step) == (self.job_id, stage, step)
        return at and info.state_epoch >= self.rolled_back

    async def sync(self, step: int) -> None:
        """At a step boundary: every replica not yet a member starts copying a member of its
        stage in the background (`_join`), and becomes a member once it is a copy at the open
        step. Nobody waits for the copy: training goes on meanwhile."""
        self.replicas()  # notices peers that moved stage: they join their new stage below
        members = self.members()
        current = {r.peer for stage in members for r in stage}
        self._left |= self.synced - current
        self.synced &= current  # those that left are forgotten, with their pauses and clients
        self._joins.forget(set[Hashable](current))
        self._failed = {p: f for p, f in self._failed.items() if p in current}
        self._refused = {p: why for p, why in self._refused.items() if p in current}
        for peer in [p for p in self._joining if p not in current]:
            self._joining.pop(peer).cancel()
        self.entry.forget(current)
        # where each peer served: of those present, and of members that left (back moved)
        self._stage_of = {
            p: k for p, k in self._stage_of.items() if p in current or p in self._left
        }
        for peer in self.standbys.choose(members, self.synced):
            self.synced.discard(peer)  # a standby from this step on: it holds no work of it
            for ledger in self.ledgers():
                self.metrics.replays.inc(len(ledger.lose(peer)))
        await self.clients.keep(members)
        for stage, replicas in enumerate(members):
            for r in replicas:
                if r.peer in self.synced or r.peer in self._joining:
                    continue
                if not self._joins.ready(r.peer):
                    continue
                if not any(m.peer in self.synced for m in replicas):
                    self._rated.warning(
                        ("no source", stage),
                        "stage %d: no replica at step %d to copy to %s",
                        stage,
                        step,
                        r.peer,
                    )
                    continue
                if not self.entry.admits(stage, r.peer):  # a new peer over the rate: it waits
                    continue
                joining = self._join(stage, r, step)
                self._joining[r.peer] = asyncio.get_running_loop().create_task(joining)

    async def _join(self, stage: int, joiner: Replica, first_step: int) -> None:
        """Have `joiner` copy a member of `stage` until it is at the open step, then admit it
        (between commits: it holds no gradients, so the step's ledger is unchanged by it). The
        first ask waits for `first_step` (the boundary's) to open."""
        ask = Backoff(self._ASK_FIRST_S, self._ASK_CAP_S)
        try:
            while joiner.peer not in self.synced:
                listed = self.members()[stage] if stage < len(self.members()) else []
                if not any((r.peer, r.address) == (joiner.peer, joiner.address) for r in listed):
                    return  # it left, moved or restarted elsewhere: the next boundary sees to it
                source = self._source(stage)
                ledgers = self.ledgers()
                ledger = ledgers[0] if ledgers else None
                if source is None or ledger is None or ledger.step < first_step:
                    await ask.sleep()
                    continue
                step, first_step, epoch = ledger.step, -1, self.epoch()
                try:
                    # `source` is named by its peer id in the follow ticket the Join brings
                    at = await self.clients.get(stage, joiner).join(
                        source.address, step, source.peer, epoch
                    )
                except GONE as e:  # the joiner itself is absent: try it less often
                    self.clients.drop(stage, joiner)  # and then over a new connection
                    delay = self._joins.failed(joiner.peer)
                    self._failed[joiner.peer] = (
                        f"not answering at {joiner.address} ({brief(e)})",
                        self.clock.now() + delay,
                    )
                    first = delay <= self._JOIN_FIRST_S * (1 + self._joins.jitter)  # then quieter
                    self._rated.log(
                        logging.WARNING if first else logging.INFO,
                        ("absent", joiner.peer),
                        "stage %d: %s could not join (retry in %.1fs): %s",
                        stage,
                        joiner.peer,
                        delay,
                        e,
                    )
                    return
                except SwarmError as e:  # it refused: the next boundary tries again
                    self._rated.warning(
                        ("refused", joiner.peer),
                        "stage %d: %s could not join: %s",
                        stage,
                        joiner.peer,
                        e,
                    )
                    self._refused[joiner.peer] = str(e)[:200]  # status says why it waits
                    return
                self._failed.pop(joiner.peer, None)
                if at >= 0:  # its copy came somewhere: a failure said before is past
                    self._refused.pop(joiner.peer, None)
                self._copying[joiner.peer] = (stage, joiner, source)
                self._sources[joiner.peer] = source.peer
                if self._admit(stage, joiner, step, at, epoch):
                    return
                await ask.sleep()
        finally:
            if self._joining.get(joiner.peer) is asyncio.current_task():
                del self._joining[joiner.peer]
                self._copying.pop(joiner.peer, None)
                self._copied.discard(joiner.peer)

    def _admit(self, stage: int, joiner: Replica, step: int, at: int, epoch: int) -> bool:
        """Make `joiner` a member if it is a copy at `step` and may become one now: its Join
        said `epoch`, which must still be the coordinator's (a rollback since: it refuses no
        work leased before that rollback yet, and is asked again)."""
        if self.standbys.of(joiner.peer) is not None:  # it follows; `readmit` promotes it
            self.standbys.answered(joiner.peer, at)
            return False
        if at == step and joiner.peer not in self.synced:
            self._copied.add(joiner.peer)  # a copy: it waits for a moment it may join at
        else:
            self._copied.discard(joiner.peer)
        current = epoch == self.epoch()  # the epoch its Join said is the coordinator's still
        if at != step or not current or not self.can_admit(step) or joiner.peer in self.synced:
            return joiner.peer in self.synced
        self._copied.discard(joiner.peer)
        self._joins.succeeded(joiner.peer)
        self.synced.add(joiner.peer)
        self._left.discard(joiner.peer)
        # A member is never asked to Join again: its copy ended at its first PREPARE, so a Join
        # would start another, whose older state would overwrite what it applied since.
        self._copying.pop(joiner.peer, None)
        log.info("stage %d: %s joined at step %d", stage, joiner.peer, step)
        source = self._sources.pop(joiner.peer, "")
        self.on_joined(step, stage, joiner.peer, source)
        for told in self.admitted:
            told(step, stage, joiner.peer, source)
        self.on_admit()
        return True

    def copying(self) -> bool:
        """Whether a replica is copying a member (or about to) to join."""
        return bool(self._joining) or any(p not in self.synced for p in self._copying)

    def _source(self, stage: int) -> Replica | None:
        """The member of `stage` a joiner copies (None: the stage has none): its first, whoever
        asks (the joiner's own loop, or `admit_copies`), so that neither restarts a copy the
        other started."""
        listed = self.members()[stage] if stage < len(self.members()) else []
        return next((r for r in listed if r.peer in self.synced), None)

    async def admit_copies(self, step: int) -> None:
        """As `step` opens, between two commits, ask every replica copying a member whether it
        is at `step`, and admit those that are. A joiner's own asks pause for up to
        `_ASK_CAP_S`: with steps shorter than that it would be asked once in many steps (and
        with delayed_update a commit starts as soon as the one before it is applied, so its
        own asks may never find a moment between commits). Each is named the member to copy
        now: one whose source died or left copies another from this ask on, not from its own
        next one."""
        # Not those admitted meanwhile (by their own asks, or an earlier call of this one).
        copying: list[tuple[int, Replica, Replica]] = []
        for peer, (stage, joiner, was) in list(self._copying.items()):
            source = self._source(stage)
            if peer in self.synced or source is None:
                continue
            if (source.peer, source.address) != (was.peer, was.address):
                self._copying[peer] = (stage, joiner, source)
                self._sources[peer] = source.peer
            copying.append((stage, joiner, source))
        epoch, asked = self.epoch(), []
        for k, joiner, source in copying:
            call = self.clients.get(k, joiner).join(source.address, step, source.peer, epoch)
            # a standby's (or one replaced for falling behind): the pool never waits for it
            if not self.standbys.nudge(joiner, call, step):
                asked.append((k, joiner, call))
        # Every standby judged as the step opens, one whose Join never answered (so not among
        # the copies asked here) too: holding no copy is behind as well (`Standbys.opened`).
        self.standbys.opened(step)
        answers = await asyncio.gather(*(call for _, _, call in asked), return_exceptions=True)
        for (stage, joiner, _), at in zip(asked, answers, strict=True):
            if isinstance(at, int):
                self._admit(stage, joiner, step, at, epoch)

    async def close(self) -> None:
        tasks = [*self._joining.values(), *self.standbys.asking()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def restarted(said: int, step: int) -> str:
    """Why a member answering at another step than the coordinator's is left out."""
    return f"it answers at step {said}, not {step} (restarted empty?)"
