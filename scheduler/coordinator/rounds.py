"""The coordinator's side of `pool.mode = "local"` (`stage_server.replica.local_round` is the
replica's): the local rule's rounds (`round_strategy`); `eager_rounds` builds the eager rules' on
them.

Every step commits as in "step" mode, except that each replica's PREPARE averages with no one
(its group is itself) over its own samples: each applies its own local update. After the step
that ends a round (`Rule.is_boundary`), every pool averages its members' pseudo-gradients and
takes the outer step, in two phases as a step does: PREPARE everywhere (each member weighs its
pseudo-gradient by its samples in the round, the pool sums them over the group's samples), then
APPLY everywhere, so no member moves on until every pool has averaged.

A member that fails the round (dead, or named by the others as the one they could not reach) is
dropped and the round repeats without it: its local steps of the round are lost with it, and
its samples of the round are counted (`swarm_coordinator_round_dropped_samples_total`, a log
line), not replayed (replaying them would count them twice at every other stage, whose replicas
have applied them already; docs/jobs.md, "Pool modes"). A member that refuses its pool's sum as
NaN or infinite fails the job (`NonFiniteStep`), with nothing of the round applied anywhere.

The route record (`swarm.model.routes`) is written here too: the runs each step counted, each
round's group, and the members the job started with. So is what `swarm status` and /metrics
say of the rounds (`status`, `RoundMetrics`): the round under way, each average's time and bytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from scheduler.coordinator.apply_again import ApplyAgain, apply_again
from scheduler.coordinator.failures import CommitStalled, NonFiniteStep, judge
from scheduler.coordinator.groups import RoundGroup
from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.listed import while_listed
from scheduler.coordinator.replicas import StageReplica
from scheduler.coordinator.round_context import RoundContext
from scheduler.coordinator.trust.sent_words import judged as sums_judged
from scheduler.coordinator.trust.sum_checks import (
    Checksums,
    checked,
    group_hosts,
    new_seed,
    replicas_to_leave_out,
)
from scheduler.coordinator.trust.sum_liars import convicted
from swarm.errors import NonFiniteGradient
from swarm.model.routes import Join, Resume, StepRuns, Sync
from swarm.model.transformer import stage_layout
from swarm.policy.backoff import Backoff
from swarm.proto import scheduler_pb2 as spb
from swarm.rpc.causes import brief
from swarm.rpc.lease import Replica

__all__ = ["Average", "PoolRounds", "RoundCall", "peers"]

# A PREPARE on one member: (stage, replica, the group's samples, group, index, round id, the
# checksums of the aggregators' sums it is asked for: `sum_checks`)
RoundCall = Callable[[int, Replica, int, RoundGroup, int, str, Checksums | None], Awaitable[object]]


def peers(replicas: list[Replica]) -> tuple[str, ...]:
    return tuple(r.peer for r in replicas)


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Average:
    """A round's averaging, ended: how long it took (seconds), when it ended (unix seconds), and
    the bytes its pools moved before compression (`PoolRounds.moved`)."""

    seconds: float
    at: float
    bytes: int


class PoolRounds:
    """The local rule's rounds: a step's PREPARE averages with no one; a round's end averages
    each pool, in two phases."""

    # A member left out mid-round holds a round its pool ended without it: not the stage's
    # state. A late receipt names no run for the route record: the replica that holds it is
    # voided before the microbatch is replayed (`late_receipts`).
    readmits = False
    adopts_late_receipts = False

    def __init__(self, context: RoundContext) -> None:
        """`context`: the job's, which its commit shares (`round_context`)."""
        self.job, self.rule, self.clients = context.job, context.rule, context.clients
        self.groups, self.membership = context.groups, context.membership
        self.metrics = context.metrics
        self.on_record = context.on_record or (lambda record: None)
        self.on_status = context.on_status
        self.dropped = 0  # samples dropped with the replicas that left mid-round, so far
        self.apply_again = ApplyAgain()  # a round's lost APPLY, as a step's (`apply_again`)
        self._samples: Counter[tuple[int, str]] = Counter()  # (stage, peer) -> in this round
        self.last: Average | None = None  # the last averaging that ended
        self.series = context.metrics.rounds()
        self._stage_sizes: dict[int, int] = {}  # stage -> its parameter bytes, once known

    async def started(self, step: int, members: list[list[Replica]]) -> None:
        """The job starts (or resumes) at `step` with `members`. The round's samples so far are
        the members' own counts (a predecessor's died with it)."""
        self.restarted()
        self.series.round.set(self._round(step))
        synced = await self._counted(members, step)
        for stage, replicas in enumerate(members):
            if step:  # a restart: the replicas go on with what the record gave them
                self.on_record(Resume(step, stage, tuple(r.peer for r in replicas)))
                continue
            for r in replicas:
                self.on_record(Join(step, stage, r.peer, None))
        await self._resumed(step, members, synced)

    async def _resumed(self, step: int, members: list[list[Replica]], synced: list[int]) -> None:
        """A round that ends at `step` and that no member applied (the predecessor died between
        the round's last step and its end) is ended now; one that some applied, the rest apply
        (each holds its sum: APPLY follows every PREPARE)."""
        if not self._is_boundary(step) or min(synced, default=step) >= step:
            return
        if max(synced) < step:
            log.warning("the round ending at step %d was not ended: ending it now", step)
            await self.end(step - 1)
            return
        log.warning("the round ending at step %d was half applied: applying the rest", step)
        await self._apply(step - 1, members, lambda c, k: c.apply_round(step), drop=False)
        for k, replicas in enumerate(members):
            self.on_record(Sync(step - 1, k, peers(replicas)))
        self._samples.clear()

    async def _counted(self, members: list[list[Replica]], step: int) -> list[int]:
        """Each member's samples of the round so far into the round's counts, from its own
        word (believed only within what a round can hold); the last round's end each applied
        (believed only from -1, none, up to `step`, where the coordinator resumes: a round's end
        past it would make an unended round look half applied, applied with no averaging;
        issue 44, N15). A member whose word is not believed counts nothing."""
        where = [(k, r) for k, replicas in enumerate(members) for r in replicas]
        infos = await asyncio.gather(
            *(self.clients.get(k, r).info() for k, r in where), return_exceptions=True
        )
        synced = []
        # a round's samples
        most = self.rule.round_steps * self.job.training.target_batch_size
        for (k, r), info in zip(where, infos, strict=True):
            if isinstance(info, BaseException):
                continue  # gone or unreachable: the first commit deals with it
            if not -1 <= info.round_synced <= step:  # a peer's word: not past the job's step
                said = info.round_synced
                log.warning(
                    "stage %d: %s says it applied the round's end at step %d (-1..%d "
                    "can be, resuming at %d): not believed, its samples counted as none",
                    k,
                    r.peer,
                    said,
                    step,
                    step,
                )
                continue
            if not 0 <= info.round_samples <= most:  # a peer's word: not past what can be
                said = info.round_samples
                log.warning(
                    "stage %d: %s says it took %d samples in the round (0..%d can be): "
                    "counted as none",
                    k,
                    r.peer,
                    said,
                    most,
                )
                continue
            self._samples[(k, r.peer)] = info.round_samples
            synced.append(info.round_synced)
        return synced

    def restarted(self) -> None:
        """Every member holds the same state anew (a start, a rollback): no round is half done."""
        self._samples.clear()

    def cancel(self) -> None:
        pass  # nothing runs in the background

    def can_admit(self, step: int) -> bool:
        """Only where a round starts, when every member's parameters are the pool's (a copy
        joins with its source's inner optimizer state)."""
        return self.starts_round(step)

    def admit_on_open(self, step: int) -> bool:
        return self.starts_round(step)

    async def whole(self, step: int) -> None:
        pass  # a round's end leaves every member whole

    def joined(self, step: int, stage: int, peer: str, source: str) -> None:
        """`peer` became a member of `stage` at `step` (a round's start), a copy of `source`."""
        self.on_record(Join(step, stage, peer, source or None))

    def starts_round(self, step: int) -> bool:
        """Whether a round starts at step `step` (a replica may join only there)."""
        return step == 0 or self._is_boundary(step)

    def _is_boundary(self, step: int) -> bool:
        return self.rule.is_boundary(step, self.job.training.steps)

    def step_pool(
        self, ledger: StepLedger, stage: int, r: Replica, group: list[str], index: int, total: int
    ) -> tuple[int, list[str], int]:
        """A local step: its own gradient, over its own samples, averaged with no one."""
        return ledger.samples_held(stage, r.peer), [r.address], 0

    async def applied(self, ledger: StepLedger) -> None:
        """`ledger`'s step was applied: its runs go on the record, its samples to the round;
        the round ends now if it ends with the step."""
        self.on_record(StepRuns(ledger.step, tuple(ledger.runs())))
        for stage in range(ledger.stages):
            for peer in ledger.holdings(stage):
                self._samples[(stage, peer)] += ledger.samples_held(stage, peer)
        if self.ends_round(ledger.step):
            await self.end(ledger.step)
        self.series.round.set(self._round(ledger.step + 1))

    def ends_round(self, step: int) -> bool:
        """Whether step `step`'s commit ends a round."""
        return self._is_boundary(step + 1)

    async def end(self, step: int) -> None:
        """End the round after step `step` on every pool; retried without the members that
        fail it, at most `runtime.max_commit_rounds` times. While a stage has no member it
        waits (the coordinator rolls back once one is back, cancelling this)."""
        syncs = await self._end(step)
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

    async def _end(self, step: int) -> list[Sync]:
        """PREPARE everywhere (the pools average), then APPLY everywhere."""
        boundary, began = step + 1, time.monotonic()
        members = await self._until_summed(step, "round", self._prepare_call(boundary))
        await self._apply(step, members, lambda c, k: c.apply_round(boundary), drop=False)
        self.averaged(began, await self.moved(members))
        return [Sync(step, k, peers(replicas)) for k, replicas in enumerate(members)]

    def averaged(self, began: float, moved: int) -> None:
        """An averaging that began at `began` (`time.monotonic()`) ended, its pools having
        moved `moved` bytes: the last one `swarm status` shows, and /metrics counts it."""
        seconds = time.monotonic() - began
        self.last = Average(seconds, time.time(), moved)
        self.series.seconds.observe(seconds)
        self.series.bytes.inc(moved)

    async def moved(self, members: list[list[Replica]]) -> int:
        """The bytes a butterfly average over each pool of `members` moves, before compression:
        each of N members sends the other N - 1 their parts of its values and each owner sends
        its part's sum back to them, 2 (N - 1) x the stage's parameter bytes, over the stages
        (the members' `swarm_stage_averaging_bytes_{sent,received}_total`, uncompressed)."""
        total = 0
        for k, replicas in enumerate(members):
            if len(replicas) > 1:
                total += 2 * (len(replicas) - 1) * await self._stage_bytes(k)
        return total

    async def _stage_bytes(self, stage: int) -> int:
        """`stage`'s parameter bytes, off the event loop once (from its layout: no values)."""
        if stage not in self._stage_sizes:
            layout = await asyncio.to_thread(stage_layout, self.job, stage)
            self._stage_sizes[stage] = sum(
                p.numel() * p.element_size() for p in layout.parameters()
            )
        return self._stage_sizes[stage]

    def _round(self, done: int) -> int:
        """The round under way after `done` steps, from 1 (the last once every step is)."""
        return min(done // self.rule.round_steps + 1, self._rounds_in_all)

    @property
    def _rounds_in_all(self) -> int:
        return -(-self.job.training.steps // self.rule.round_steps)  # the last may be shorter

    def status(self, done: int) -> spb.RoundStatus:
        """What `swarm status` says of the rounds after `done` committed steps."""
        every, steps = self.rule.round_steps, self.job.training.steps
        last = self.last or Average(0.0, 0.0, 0)  # unset before the first
        return spb.RoundStatus(
            rule=str(self.rule.kind),
            round=self._round(done),
            rounds=self._rounds_in_all,
            round_steps=every,
            next_average_in=max(min((done // every + 1) * every, steps) - done, 0),
            last_seconds=last.seconds,
            last_at=last.at,
            last_bytes=last.bytes,
        )

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
        if not drop:  # where no member of a stage applied, a lost APPLY is sent again
            results = await apply_again(
                f"round after step {step}",
                call,
                where,
                results,
                self.membership.members,
                self.clients,
                self.apply_again,
            )
        done: list[list[Replica]] = [[] for _ in members]
        for (k, r), result in zip(where, results, strict=True):
            if isinstance(result, BaseException):
                log.warning(
                    "round after step %d: apply on %s (stage %d) failed: %s",
                    step,
                    r.peer,
                    k,
                    result,
                )
                if drop:
                    self.membership.drop(r.peer, f"its apply failed ({brief(result)})")
            else:
                done[k].append(r)
        return done

    def _prepare_call(self, boundary: int) -> RoundCall:
        """PREPARE of the round ending at `boundary` on one member."""

        def call(
            stage: int,
            r: Replica,
            total: int,
            group: RoundGroup,
            index: int,
            rid: str,
            checks: Checksums | None,
        ) -> Awaitable[object]:
            return self.clients.get(stage, r).prepare_round(
                boundary,
                total,
                list(group.members),
                index,
                rid,
                parts=group.parts,
                checks=checks,
                peers=group.peers,
            )

        return call

    async def _until_summed(
        self, step: int, what: str, call: RoundCall, members: list[list[Replica]] | None = None
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
            try:
                reason = await self._prepare(current, f"{step}/{what}{failures}", call)
            except NonFiniteGradient as e:
                raise NonFiniteStep(f"the round after step {step} ({what}): {e}") from None
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
        self, members: list[list[Replica]], round_id: str, call: RoundCall
    ) -> str | None:
        """`call` (a PREPARE) on every one of `members`; None when every one averaged, else
        why not (the members that failed it are dropped by then)."""
        where, calls = [], list[tuple[int, Replica, Awaitable[object]]]()
        groups: dict[int, RoundGroup] = {}
        checks: dict[int, dict[int, Checksums]] = {}  # stage -> contributor -> its checksums
        for stage, replicas in enumerate(members):
            group = groups[stage] = self.groups.of(stage, replicas)
            seed = new_seed()  # this stage's own: a replica of another stage never learns it
            total = sum(self._samples[(stage, r.peer)] for r in replicas)
            for index, r in enumerate(replicas):
                where.append((stage, r))
                if (check := checked(group, seed)) is not None:
                    checks.setdefault(stage, {})[index] = check
                calls.append((stage, r, call(stage, r, total, group, index, round_id, check)))
        # A replica the registry leaves out meanwhile (hung, moved) is not waited for, nor are
        # its round's others, who wait for its parts: `listed`.
        pools = [groups[stage].members for stage, _ in where]
        results = await while_listed(self.membership.members, calls, "round's PREPARE", pools=pools)
        failed = [
            (k, r, e)
            for (k, r), e in zip(where, results, strict=True)
            if isinstance(e, BaseException)
        ]
        if not failed:  # every part's sum passes its checksum, or its owner sits out
            accusations, lines = sums_judged(groups, checks)
            if lines:
                named = self.groups.blame(groups, accusations)
                contributors = {k: len(g.members) - len(g.aggregators) for k, g in groups.items()}
                # Those the evidence convicts leave alone (`sum_liars`: not banned here yet);
                # else whom the checks named (`replicas_to_leave_out`).
                liars = convicted(groups, checks)
                hosts = group_hosts(groups)
                leaving = liars or replicas_to_leave_out(accusations, contributors, hosts)
                for stage, out in leaving.items():
                    for index in out:  # a replica owner's wrong sum: it leaves (issue 55)
                        named.append(members[stage][index].peer)
                        self.membership.drop(
                            members[stage][index].peer,
                            f"its sum of round {round_id} failed the checks",
                        )
                log.warning("round %s: %s: %s sit(s) out", round_id, "; ".join(lines), named)
            return "; ".join(lines) or None
        self._refuse_nonfinite(failed)
        judged = judge(f"round {round_id}", failed, members)
        self.groups.blame(groups, judged.accusations)
        for _, r, error in judged.alone:  # it failed by itself: gone, or refused
            self.membership.drop(r.peer, f"round {round_id}: {brief(error)}")
        for _, r, named_by in judged.named(members):
            self.membership.drop(r.peer, f"round {round_id}: {', '.join(named_by)} named it")
        return judged.reason

    def _refuse_nonfinite(self, failed: list[tuple[int, Replica, BaseException]]) -> None:
        """A member that refused its pool's sum as NaN or infinite (`NonFiniteGradient`, before
        keeping or applying any of it) fails the job (`_until_summed` raises `NonFiniteStep`):
        no retry, no member dropped (the same parts sum to the same poison), and no APPLY of
        the round goes out."""
        refused = [(k, r, e) for k, r, e in failed if isinstance(e, NonFiniteGradient)]
        if not refused:
            return
        for stage in sorted({k for k, _, _ in refused}):
            self.metrics.nonfinite(stage)
        raise NonFiniteGradient(
            "its pool sum was refused as NaN or infinite by "
            + "; ".join(f"{r.peer}: {e}" for _, r, e in refused)
            + ". No replica applied it, and the job fails: the same parts sum to the same again "
            "(a lower optimizer.lr or pool.outer_lr, or the data, may be at fault)"
        )

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
