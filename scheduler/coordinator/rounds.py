"""The coordinator's side of `pool.mode = "local"` (`stage_server.local_round` is the replica's).

Every step commits as in "step" mode, except that each replica's PREPARE averages with no one
(its group is itself) over its own samples: each applies its own local update. After the step
that ends a round (`is_boundary`), every pool averages its members' pseudo-gradients and takes
the outer step, in two phases as a step does: PREPARE everywhere (each member weighs its
pseudo-gradient by its samples in the round, the pool sums them over the group's samples), then
APPLY everywhere, so no member moves on until every pool has averaged.

A member that fails the round (dead, or named by the others as the one they could not reach) is
dropped and the round repeats without it: its local steps of the round are lost with it, and
its samples of the round are counted (`swarm_coordinator_round_dropped_samples_total`, a log
line), not replayed (replaying them would count them twice at every other stage, whose replicas
have applied them already; docs/jobs.md, "Pool modes").

The route record (`swarm.model.routes`) is written here too: the runs each step counted, each
round's group, and the members the job started with.

With `pool.overlap = "eager"` a round's end waits for no network (`_end_eager`): every member
takes its outer step at once (EAGER_STEP: the last round's average plus its fresh share minus
its last share), and the pools sum the fresh shares in the background (EAGER_AVERAGE) while the
next round trains; the next round's end waits for that sum first (`drain`), as do a checkpoint
and a copy's admission (they need every member's state whole). A member that fails the
averaging is dropped and the others sum again without it: its share of the round is lost (its
samples counted as dropped), and the next round's record says whose shares the average holds
(`Sync.averaged`). The job's last round is waited for (EAGER_LAST: the whole sum, then the outer
step) and the trained model is the members' mean (EAGER_MEAN).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

from scheduler.coordinator.commit import CommitStalled, culprits
from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.membership import Membership
from scheduler.coordinator.metrics import CoordinatorMetrics
from scheduler.coordinator.replicas import ReplicaClients, StageReplica
from swarm.errors import Aborted
from swarm.job.config import JobConfig
from swarm.job.rule import rule_of
from swarm.model.optim import is_boundary
from swarm.model.routes import Join, Record, StepRuns, Sync
from swarm.policy.backoff import Backoff
from swarm.proto import stage_pb2 as pb
from swarm.rpc.lease import Replica

__all__ = ["PoolRounds"]

# A PREPARE on one member: (stage, replica, the group's samples, group, index, round id)
_Call = Callable[[int, Replica, int, list[str], int, str], Awaitable[object]]


def _peers(replicas: list[Replica]) -> tuple[str, ...]:
    return tuple(r.peer for r in replicas)


log = logging.getLogger(__name__)


class PoolRounds:
    def __init__(
        self,
        job: JobConfig,
        clients: ReplicaClients,
        membership: Membership,
        metrics: CoordinatorMetrics,
        on_record: Callable[[Record], None] | None = None,
        on_status: Callable[[str], Awaitable[None] | None] | None = None,
    ) -> None:
        """`on_record`: the route record's sink; `on_status(text)`: what `swarm status` should
        say (a round that dropped a replica's samples)."""
        self.job, self.clients, self.membership, self.metrics = job, clients, membership, metrics
        self.on_record = on_record or (lambda record: None)
        self.on_status = on_status
        self.dropped = 0  # samples dropped with the replicas that left mid-round, so far
        self._samples: Counter[tuple[int, str]] = Counter()  # (stage, peer) -> in this round
        # pool.overlap = "eager": the last round's averaging under way (its result: per stage,
        # the members whose shares it summed), the members that took each stage's last outer
        # step, and whose shares made each stage's last average once it is known
        self.eager = rule_of(job).eager
        self._pending: asyncio.Task[dict[int, tuple[str, ...]]] | None = None
        self._stepped: dict[int, tuple[str, ...]] = {}
        self._averaged: dict[int, tuple[str, ...]] = {}

    async def started(self, step: int, members: list[list[Replica]]) -> None:
        """The job starts (or resumes) at `step` with `members`. The round's samples so far are
        the members' own counts (a predecessor's died with it). With the eager overlap, a
        coordinator resuming mid-job does not know whether its predecessor's sum of the last
        round's shares arrived: it is summed again (the same shares, so the same sum where it
        had). Without it, a round that ends at `step` and that no member applied (the
        predecessor died between the round's last step and its end) is ended now; one that some
        applied, the rest apply (each holds its sum: APPLY follows every PREPARE). (An eager
        round left so is not, yet: its background sum fails and the stage rolls back.)"""
        self.restarted()
        synced = await self._counted(members)
        every = rule_of(self.job).round_steps
        last = step - step % every  # the last round's end at or before `step`
        if self.eager and last > 0 and all(members):
            copied = [list(replicas) for replicas in members]
            self._pending = asyncio.get_running_loop().create_task(
                self._sum_shares(last - 1, copied, {})
            )
        for stage, replicas in enumerate(members):
            for r in replicas:
                self.on_record(Join(step, stage, r.peer, None))
        if self.eager or not is_boundary(self.job, step) or min(synced, default=step) >= step:
            return
        if max(synced) < step:
            log.warning("the round ending at step %d was not ended: ending it now", step)
            await self.end(step - 1)
            return
        log.warning("the round ending at step %d was half applied: applying the rest", step)
        await self._apply(step - 1, members, lambda c, k: c.apply_round(step), drop=False)
        for k, replicas in enumerate(members):
            self.on_record(Sync(step - 1, k, _peers(replicas)))
        self._samples.clear()

    async def _counted(self, members: list[list[Replica]]) -> list[int]:
        """Each member's samples of the round so far into the round's counts, from its own
        word (believed only within what a round can hold); the last round's end each applied."""
        where = [(k, r) for k, replicas in enumerate(members) for r in replicas]
        infos = await asyncio.gather(
            *(self.clients.get(k, r).info() for k, r in where), return_exceptions=True
        )
        synced = []
        # a round's samples
        most = rule_of(self.job).round_steps * self.job.training.target_batch_size
        for (k, r), info in zip(where, infos, strict=True):
            if isinstance(info, BaseException):
                continue  # gone or unreachable: the first commit deals with it
            if not 0 <= info.round_samples <= most:  # a peer's word: not past what can be
                said = info.round_samples
                log.warning("stage %d: %s says it took %d samples in the round (0..%d can be): "
                            "counted as none", k, r.peer, said, most)  # fmt: skip
                continue
            self._samples[(k, r.peer)] = info.round_samples
            synced.append(info.round_synced)
        return synced

    def restarted(self) -> None:
        """Every member holds the same state anew (a start, a rollback): no round is half done."""
        self._samples.clear()
        self.cancel()
        self._stepped, self._averaged = {}, {}

    @property
    def pending(self) -> bool:
        """pool.overlap = "eager": whether a round's averaging is not drained yet."""
        return self._pending is not None

    async def drain(self) -> None:
        """Wait for the last round's averaging (eager), retried without the members that fail
        it; `CommitStalled` once it failed `runtime.max_commit_rounds` times."""
        task = self._pending
        if task is None:
            return
        try:
            self._averaged.update(await asyncio.shield(task))
        finally:
            if task.done():
                self._pending = None

    def cancel(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None

    def joined(self, step: int, stage: int, peer: str, source: str) -> None:
        """`peer` became a member of `stage` at `step` (a round's start), a copy of `source`."""
        self.on_record(Join(step, stage, peer, source or None))

    def starts_round(self, step: int) -> bool:
        """Whether a round starts at step `step` (a replica may join only there)."""
        return step == 0 or is_boundary(self.job, step)

    def applied(self, ledger: StepLedger) -> None:
        """`ledger`'s step was applied: its runs go on the record, its samples to the round."""
        self.on_record(StepRuns(ledger.step, tuple(ledger.runs())))
        for stage in range(ledger.stages):
            for peer in ledger.holdings(stage):
                self._samples[(stage, peer)] += ledger.samples_held(stage, peer)

    def ends_round(self, step: int) -> bool:
        """Whether step `step`'s commit ends a round."""
        return is_boundary(self.job, step + 1)

    async def end(self, step: int) -> None:
        """End the round after step `step` on every pool; retried without the members that
        fail it, at most `runtime.max_commit_rounds` times. While a stage has no member it
        waits (the coordinator rolls back once one is back, cancelling this)."""
        syncs = await (self._end_eager(step) if self.eager else self._end_plain(step))
        for sync in syncs:
            self.on_record(sync)
        kept = {(sync.stage, peer) for sync in syncs for peer in sync.group}
        lost = {key: n for key, n in self._samples.items() if key not in kept and n}
        self._samples.clear()
        await self._say(self._count_dropped(step, lost, "left mid-round"))

    async def _say(self, said: str) -> None:
        if said and self.on_status is not None:
            shown = self.on_status(said)
            if shown is not None:
                await shown

    async def _end_plain(self, step: int) -> list[Sync]:
        """overlap = "none": PREPARE everywhere (the pools average), then APPLY everywhere."""
        boundary = step + 1
        members = await self._until_summed(step, "round", self._prepare_call(boundary))
        await self._apply(step, members, lambda c, k: c.apply_round(boundary), drop=False)
        return [Sync(step, k, _peers(replicas)) for k, replicas in enumerate(members)]

    async def _end_eager(self, step: int) -> list[Sync]:
        """overlap = "eager": the last round's sum first (`drain`), then every member's outer
        step, at once; this round's sum goes on in the background. The job's last round is
        `_end_last`."""
        await self.drain()
        if step + 1 >= self.job.training.steps:
            return await self._end_last(step)
        boundary, members = step + 1, await self._every_stage_served()
        totals = [sum(self._samples[(k, r.peer)] for r in rs) for k, rs in enumerate(members)]
        stepped = await self._apply(
            step,
            members,
            lambda c, k: c.eager(pb.EAGER_STEP, boundary, totals[k]),
            drop=True,
        )
        syncs = [
            Sync(step, k, _peers(replicas), self._averaged_of(k))
            for k, replicas in enumerate(members)
        ]
        self._stepped = {k: _peers(rs) for k, rs in enumerate(members) if totals[k]}
        # A stage whose round took no sample took no outer step: nothing to sum.
        summing = [rs if totals[k] else [] for k, rs in enumerate(stepped)]
        samples = {key: n for key, n in self._samples.items() if n}
        failed = {(k, r.peer): samples.get((k, r.peer), 0) for k, rs in enumerate(members)
                  for r in rs if r not in stepped[k]}  # fmt: skip
        await self._say(self._count_dropped(step, failed, "failed the round's outer step"))
        self._pending = asyncio.create_task(self._sum_shares(step, summing, samples))
        return syncs

    async def _sum_shares(
        self, step: int, members: list[list[Replica]], samples: dict[tuple[int, str], int]
    ) -> dict[int, tuple[str, ...]]:
        """The background sum of the round's shares (EAGER_AVERAGE); per stage, whose. The
        samples of a member whose share it could not sum are dropped (`samples`: the round's)."""
        call = self._prepare_call(step + 1, pb.EAGER_AVERAGE)
        summed = await self._until_summed(step, "eager", call, members)
        kept = {(k, r.peer) for k, rs in enumerate(summed) for r in rs}
        lost = {(k, r.peer): samples.get((k, r.peer), 0) for k, rs in enumerate(members)
                for r in rs if (k, r.peer) not in kept}  # fmt: skip
        await self._say(self._count_dropped(step, lost, "failed the round's averaging"))
        return {k: _peers(rs) for k, rs in enumerate(summed) if members[k]}

    async def _end_last(self, step: int) -> list[Sync]:
        """The job's last round under eager: the whole sum of the fresh shares (EAGER_LAST's
        PREPARE), every member's outer step with it (its APPLY), then the members' mean
        (EAGER_MEAN), the trained model."""
        boundary = step + 1
        members = await self._until_summed(
            step, "last", self._prepare_call(boundary, pb.EAGER_LAST)
        )
        applied = await self._apply(
            step, members, lambda c, k: c.eager_last_apply(boundary), drop=True
        )
        meaned = await self._until_summed(
            step, "mean", self._prepare_call(boundary, pb.EAGER_MEAN), applied
        )
        syncs = []
        for k, replicas in enumerate(members):
            group, mean = _peers(replicas), _peers(meaned[k])
            syncs.append(
                Sync(step, k, group, self._averaged_of(k), None if mean == group else mean)
            )
        return syncs

    def _averaged_of(self, stage: int) -> tuple[str, ...] | None:
        """Whose shares made `stage`'s last average, for the record: None when they are all
        that took the last outer step (the record's default)."""
        averaged = self._averaged.get(stage)
        return None if averaged is None or averaged == self._stepped.get(stage) else averaged

    async def _apply(
        self,
        step: int,
        members: list[list[Replica]],
        call: Callable[[StageReplica, int], Awaitable[object]],
        *,
        drop: bool,
    ) -> list[list[Replica]]:
        """An APPLY (`call(client, stage)`) on every one of `members`; the members it
        succeeded on. One that fails rejoins by copying, as after a step; `drop`: it is left
        out at once (eager: its state is not the round's)."""
        where = [(k, r) for k, replicas in enumerate(members) for r in replicas]
        results = await asyncio.gather(
            *(call(self.clients.get(k, r), k) for k, r in where), return_exceptions=True
        )
        done: list[list[Replica]] = [[] for _ in members]
        for (k, r), result in zip(where, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("round after step %d: apply on %s (stage %d) failed: %s",
                            step, r.peer, k, result)  # fmt: skip
                if drop:
                    self.membership.drop(r.peer)
            else:
                done[k].append(r)
        return done

    def _prepare_call(self, boundary: int, op: int = pb.EAGER_NONE) -> _Call:
        """PREPARE of the round ending at `boundary` on one member (`op`: eager's, or none)."""

        def call(
            stage: int, r: Replica, total: int, group: list[str], index: int, rid: str
        ) -> Awaitable[object]:
            client = self.clients.get(stage, r)
            if op == pb.EAGER_NONE:
                return client.prepare_round(boundary, total, group, index, rid)
            return client.eager(op, boundary, total, group, index, rid)

        return call

    async def _until_summed(
        self, step: int, what: str, call: _Call, members: list[list[Replica]] | None = None
    ) -> list[list[Replica]]:
        """`call` on every one of `members` (default: the members, once every stage has one)
        until a try succeeds on all, each retry without the members dropped since (those
        that failed the last try among them); the members of the try that did. At most
        `runtime.max_commit_rounds` tries."""
        failures, wait = 0, Backoff(first_s=0.1, cap_s=2.0)
        bound = self.job.runtime.max_commit_rounds
        while True:
            if members is None:
                current = await self._every_stage_served()
            else:  # those of `members` still members
                peers = {r.peer for replicas in self.membership.replicas() for r in replicas}
                current = [[r for r in replicas if r.peer in peers] for replicas in members]
            reason = await self._prepare(current, f"{step}/{what}{failures}", call)
            if reason is None:
                return current
            failures += 1
            self.metrics.aborted_rounds.inc()
            if failures >= bound:
                raise CommitStalled(
                    f"the round after step {step} ({what}): {failures} averaging rounds failed "
                    f"(runtime.max_commit_rounds = {bound}); the last: {reason}"
                )
            await wait.sleep()

    async def _every_stage_served(self) -> list[list[Replica]]:
        """The members, once every stage has one (while one has none, the coordinator rolls
        back once it is back, cancelling this)."""
        wait = Backoff(first_s=0.1, cap_s=2.0)
        members = self.membership.replicas()
        while not all(members):
            await wait.sleep()
            members = self.membership.replicas()
        return members

    async def _prepare(
        self, members: list[list[Replica]], round_id: str, call: _Call
    ) -> str | None:
        """`call` (a PREPARE) on every one of `members`; None when every one averaged, else
        why not (the members that failed it are dropped by then)."""
        where, calls = [], []
        for stage, replicas in enumerate(members):
            group = [r.address for r in replicas]
            total = sum(self._samples[(stage, r.peer)] for r in replicas)
            for index, r in enumerate(replicas):
                where.append((stage, r))
                calls.append(call(stage, r, total, group, index, round_id))
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [(k, r, e) for (k, r), e in zip(where, results, strict=True)
                  if isinstance(e, BaseException)]  # fmt: skip
        if not failed:
            return None
        accusations: dict[int, dict[int, set[int]]] = {}
        for stage, r, error in failed:
            log.warning("round %s at stage %d failed on %s: %r", round_id, stage, r.peer, error)
            if isinstance(error, Aborted) and error.missing:
                accusations.setdefault(stage, {})[members[stage].index(r)] = set(error.missing)
            elif not isinstance(error, Aborted):  # it failed by itself: gone, or refused
                self.membership.drop(r.peer)
        for stage, named in accusations.items():
            for i in culprits(members[stage], named, {}):
                self.membership.drop(members[stage][i].peer)
        return "; ".join(f"stage {k} {r.peer}: {type(e).__name__}: {e}" for k, r, e in failed)

    def _count_dropped(self, step: int, lost: dict[tuple[int, str], int], why: str) -> str:
        """Count the samples of `lost` ((stage, peer) -> its samples of the round: a replica's
        local steps that no average holds); a line for `swarm status` ("" when none)."""
        said = []
        for (stage, peer), samples in sorted(lost.items()):
            if not samples:
                continue
            self.metrics.round_dropped.inc(samples)
            self.dropped += samples
            said.append(f"stage {stage}: {peer} {why}, {samples} samples dropped")
            log.warning(
                "round after step %d: stage %d: %s %s: its %d samples of the round are not in "
                "the pool's average",
                step,
                stage,
                peer,
                why,
                samples,
            )
        if not said:
            return ""
        return (
            f"round after step {step}: " + "; ".join(said) + f" ({self.dropped} in all: a "
            "replica's local steps leave with it; the pool averaged without them)"
        )
