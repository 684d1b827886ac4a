"""The step coordinator: leases each step's microbatches to trainers, collects where their
gradients live, and commits the step on every replica of every stage in two phases.

`LocalCoordinator` runs in the process that owns the job's step: the scheduler (for its embedded
trainer and, over gRPC, remote trainers) or a standalone `swarm trainer --stage-servers`. It owns
the step's lifecycle (open, commit, retry, next step, rollback) and composes the rest: the ledger
(`ledger`), the two-phase commit and voids (`commit`), the members (`membership`), checkpoints and
rollback states (`recovery`) and when to roll back (`rollback`), the connections to replicas
(`replicas`), and each committed step's record and timing (`step_records`). Its steps are *live*
from their opening until their commit is applied (`live_steps`: one at a time, or two with
`training.delayed_update`); a returned microbatch's late receipts are checked before it is
leased again (`late_receipts`); a lease with nothing to give waits (`long_poll`); the rounds
of the job's rule (`round_strategy`) run after the commits that end them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry

from scheduler.coordinator.commit import NonFiniteStep, TwoPhaseCommit
from scheduler.coordinator.failures import CommitStalled
from scheduler.coordinator.groups import Groups
from scheduler.coordinator.late_receipts import LateReceipts
from scheduler.coordinator.lease_signer import LeaseSigner
from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.live_steps import Live, window_of
from scheduler.coordinator.long_poll import LongPoll
from scheduler.coordinator.membership import Membership
from scheduler.coordinator.metrics import CoordinatorMetrics
from scheduler.coordinator.recovery import Recovery
from scheduler.coordinator.replicas import (
    GrpcReplicas,
    ReplicaClients,
    ReplicaFactory,
    StageReplica,
    grpc_replicas,
)
from scheduler.coordinator.rollback import Rollback
from scheduler.coordinator.round_context import RoundContext
from scheduler.coordinator.round_strategy import rounds_of
from scheduler.coordinator.shares import Shares
from scheduler.coordinator.step_records import StepRecords
from scheduler.coordinator.trust.bans import Bans, OnBan
from scheduler.coordinator.trust.standing import BanBook, Members, Standing
from scheduler.coordinator.voids import Voids
from swarm.clock import Clock, MonotonicClock
from swarm.device.kernels import audits
from swarm.job.config import JobConfig
from swarm.job.rule import rule_of
from swarm.model.routes import Record
from swarm.ops.progress import StepRecord
from swarm.ops.rated import RatedLog
from swarm.policy.backoff import Backoff
from swarm.rpc.lease import Lease, MicrobatchResult, Replica, Working
from swarm.rpc.push_call import push_deadline_s

__all__ = ["LocalCoordinator"]

log = logging.getLogger(__name__)


async def _maybe_await(result: Awaitable[None] | None) -> None:
    if result is not None:
        await result


class LocalCoordinator:
    _CHECK_EVERY_S = 1.0  # members are checked at most this often when trainers give work back

    def __init__(
        self,
        job: JobConfig,
        job_id: str,
        members: Callable[[], list[list[Replica]]],
        *,
        token: str | None = None,
        steps: int | None = None,
        on_step: Callable[[StepRecord], Awaitable[None] | None] | None = None,
        metrics: CoordinatorMetrics | None = None,
        checkpoint_dir: Path | None = None,
        on_rollback: Callable[[int], Awaitable[None] | None] | None = None,
        on_status: Callable[[str], Awaitable[None] | None] | None = None,
        connect: ReplicaFactory | None = None,
        clock: Clock | None = None,
        on_route: Callable[[Record], None] | None = None,
        checkpoint_every_s: float | None = None,
        groups: Groups | None = None,
        on_ban: OnBan | None = None,
        bans: BanBook | None = None,
    ) -> None:
        """`members()`: per stage, the replicas serving it now (from the peer registry).
        `on_status(text)`: something `swarm status` should say (a replica left out of its pool).
        `connect` and `clock` are for tests: replicas other than gRPC ones, time that is told.
        `on_route(record)`: pool.mode = "local"'s route record (`swarm.model.routes`).
        `checkpoint_every_s`: checkpoint at least this often besides every `checkpoint_every`
        steps (with `checkpoint_dir`). `groups`: how each round's group is made: the parts by
        the members' links, the aggregators after the replicas (default: equal parts, none).
        `on_ban(ban)`: a peer was banned, and why (`Ban.text`); `bans`: the job's bans kept."""
        self.metrics = metrics or CoordinatorMetrics(job_id, CollectorRegistry())
        standing = Standing(job_id, bans)  # who is banned: the one filter of every view
        self.barred = _barred(members, standing)
        members = standing.members(members)
        self.job, self.job_id, self.members, self.token = job, job_id, members, token
        self.steps = steps if steps is not None else job.training.steps
        self.on_step, self.on_rollback, self.on_status = on_step, on_rollback, on_status
        self.checkpoint_dir = checkpoint_dir
        self.clock = clock or MonotonicClock()
        # Each task's lease ticket, signed with the key the replicas' calls are signed with:
        # the replicas of a job the scheduler placed ask for it (`swarm.net.lease_tickets`).
        signing = connect.signing if isinstance(connect, GrpcReplicas) else None
        # On the push plane, with the run each task is pushed as, where its pushes keep
        # records for the job's audits.
        records = job.runtime.data_plane == "push" and audits(job)
        self._tickets = LeaseSigner(job_id, signing, records)
        self._shares = Shares(self.clock, job.runtime.lease_timeout_s)
        self._rated = RatedLog(log, clock=self.clock.now)  # what a trainer's call may repeat
        self._records = StepRecords(self.metrics, job.model.seq_len)
        rule = rule_of(job)
        self._window = window_of(rule, job, self.steps, self.clock)
        self.finished = asyncio.Event()
        self.error: BaseException | None = None
        # Why a trainer last gave microbatches back, until one goes through: a remote
        # trainer's cause, for the job's status (`scheduler.stalls`)
        self.trainers_failure: str | None = None
        self._poll = LongPoll(self.finished, self._window.commits)
        self._wake = self._poll.wake
        self._take_members(members, standing, connect)
        self.groups = groups or Groups(clock=self.clock)
        context = RoundContext(
            job, rule, self.clients, self.membership, self.metrics, self.groups, on_route, on_status
        )
        self._end_steps(context, standing, members, checkpoint_every_s, on_rollback, on_ban)
        self._checked = -self._CHECK_EVERY_S
        self._receipts = LateReceipts(
            self.clients,
            self.replicas,
            self._window,
            self.rounds.adopts_late_receipts,
            job.training.microbatch_size,
            void=self.voids.void_duplicate,
            wake=self._wake,
            checked=self._maybe_commit,
            wait_s=push_deadline_s(job),  # a push in flight ends by its deadline
        )
        self._closed = False

    def _take_members(
        self,
        members: Callable[[], list[list[Replica]]],
        standing: Standing,
        connect: ReplicaFactory | None,
    ) -> None:
        """Who trains: a client per replica, and the membership that admits a replica to the
        open step once it is in sync (a member the job had before, `standing.first_seen`, is
        known to it)."""
        job = self.job
        self.clients = ReplicaClients(
            connect or grpc_replicas(job, self.job_id, self.token),
            grace_s=job.runtime.commit_timeout_s,
        )
        self.membership = Membership(
            self.job_id,
            members,
            self.clients,
            self._window.ledgers,
            self.metrics,
            self.clock,
            can_admit=self._can_admit,
            on_admit=self._wake,
            grad_clip=job.training.grad_clip,
            on_joined=self._joined,
            known=standing.first_seen.__contains__,  # the job's members before (kept)
        )

    def _end_steps(
        self,
        context: RoundContext,
        standing: Standing,
        members: Callable[[], list[list[Replica]]],
        checkpoint_every_s: float | None,
        on_rollback: Callable[[int], Awaitable[None] | None] | None,
        on_ban: OnBan | None,
    ) -> None:
        """How a step ends, and what undoes one: its rounds, the voids and the checkpoints,
        the rollback over them, the bans given the rollback and the voids, then the two-phase
        commit that judges each round (each part made once what it needs exists)."""
        job = self.job
        self.rounds = rounds_of(context)
        self.voids = voids = Voids(context)
        self.recovery = Recovery(
            job, self.clients, self.checkpoint_dir, checkpoint_every_s, self.clock, self.on_status
        )
        self._rollback = Rollback(
            job,
            self.clock,
            self._window,
            self.rounds,
            self.membership,
            self.recovery,
            self.metrics,
            members,
            barred=self.barred,
            open_step=self._open,
            on_rollback=on_rollback,
            wake=self._wake,
            fail=self._fail,
            on_status=self.on_status,
        )
        self.bans = Bans(
            standing,
            self.metrics,
            roll_back_to=self._rollback.to,
            void=voids.void_duplicate,
            on_ban=on_ban,
            job=job,
        )
        self.two_phase = TwoPhaseCommit(context, self.rounds, voids, self.bans)

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self, recorded: int | None = None, wait_s: float = 0.0) -> int:
        """Bring every replica to one step (finishing a half-applied commit) and open it.
        `recorded`: the job's step as its store has it, whose holders a start waits for
        `wait_s` at most (`holders`); None where no store keeps one (`swarm trainer`)."""
        if isinstance(self.clients.factory, GrpcReplicas):
            await self.clients.factory.prepare()
        await self.recovery.sweep()
        step = await self._rollback.reconcile(recorded, wait_s)
        await self.rounds.started(step, self.replicas())
        self._open(step)
        return step

    @property
    def ledger(self) -> StepLedger | None:
        """The newest live step's ledger (None once the job is done)."""
        newest = self._window.newest
        return newest.ledger if newest else None

    def _open(self, step: int, beside: bool = False) -> None:
        """Open `step`: the only live step, or (`beside`, delayed_update) the next one beside
        the step whose commit is starting; or the job is done."""
        self._records.opened(step)
        if self._window.open(step, beside) is None:
            self.finished.set()
        else:
            self._rollback.opened()
        self._wake()

    def _can_admit(self, step: int) -> bool:
        """A replica caught up with `step` becomes a member only while `step` is the members'
        and no commit (whose PREPARE group is fixed) or rollback is under way."""
        ledgers = self._window.ledgers()
        return (
            bool(ledgers)
            and ledgers[0].step == step
            and self.rounds.can_admit(step)
            and not self._window.committing()
            and not self._rollback.running
            and not self._closed
        )

    def _joined(self, step: int, stage: int, peer: str, source: str) -> None:
        self.rounds.joined(step, stage, peer, source)

    async def close(self) -> None:
        self._closed = True
        self._wake()
        for task in self._window.commits():
            task.cancel()
        self._rollback.cancel()
        self._receipts.cancel()
        self.rounds.cancel()
        # Each part is closed whatever the one before did, a cancellation included (a `swarm
        # cancel` while the last checkpoint is flushed): none is left open, or writing.
        try:
            await self.recovery.close(finished=self.finished.is_set())
        finally:
            try:
                await self.membership.close()
            finally:
                await self.clients.close()

    def client(self, stage: int, replica: Replica) -> StageReplica:
        """The connection to `replica` at `stage` (the model's export downloads through it)."""
        return self.clients.get(stage, replica)

    def progress(self) -> str:
        """Where the oldest open step is, in words (for a stall's message), and what of it waits
        for pushes still in flight (`scheduler.coordinator.push_waits`)."""
        ledgers = self._window.ledgers()
        waiting = self._receipts.waits.said(ledgers[0]) if ledgers else ""
        return self._window.progress() + waiting

    def set_aside(self) -> set[str]:
        """The peers on the job's stages that serve it no work: its standbys, and the peers
        banned from it (the rebalancer neither moves them nor counts them as replicas)."""
        banned = self.barred(list(range(self.job.training.stages))).values()
        return self.membership.standbys.peers() | {peer for peers in banned for peer in peers}

    def trainers_silent_since(self) -> float | None:
        """Since when no trainer has asked for work, once past a lease's time
        (`Shares.silent_since`); else None."""
        return self._shares.silent_since()

    def replicas(self) -> list[list[Replica]]:
        """Per stage, the members at the coordinator's step: trainers see and use only these."""
        return self.membership.replicas()

    # -- trainers -------------------------------------------------------------------------------
    async def lease(
        self, trainer: str, count: int, *, wait_s: float = 0.0, working: Sequence[Working] = ()
    ) -> Lease:
        """Up to `count` tasks for `trainer`, renewing its leases of `working` first. A long poll
        (`long_poll`): with nothing to give, it waits at most `wait_s` for work."""
        self._shares.heard(trainer)
        for ledger in self._window.ledgers():
            ledger.renew(trainer, [index for step, index in working if step == ledger.step])
        return await self._poll.poll(
            lambda: self._lease_now(trainer, count), wait_s, lambda: self._closed
        )

    def _lease_now(self, trainer: str, count: int) -> Lease:
        if self.error:
            raise self.error
        members = self.replicas()
        if self.ledger is None:
            return Lease(self.steps, [], members, done=True)
        newest = self.ledger.step
        if any(not stage for stage in members):
            self._rollback.maybe()
            return Lease(newest, [], members)  # no work while a stage has no replica
        # Every lease's view (a trainer routes by its last one's) without a replica whose work
        # of a step a yardstick refused, until that step is applied: its replays are judged on
        # another replica (`StepLedger.routes`), and with delayed_update the step beside it sees
        # the same stages.
        routes = members
        for unapplied in self._window.ledgers():
            routes = unapplied.routes(routes)
        for live in self._window.working():  # the oldest first: replays hold up the next
            ledger = live.ledger
            returned = ledger.returned()
            if returned:
                self._receipts.check(ledger, returned)
            exclude = set(returned)
            share = min(count, self._shares.share(ledger, trainer, ledger.leasable(exclude)))
            leased = self._rollback.stamped(ledger.lease(trainer, share, exclude=exclude))
            if leased:
                self.bans.saw(members, ledger.step)  # where a ban would roll back to
                self._open_next_early()
                # Signed with their audits: a task whose contribution is audited is pushed as a
                # run of its own, whose records its audit redoes (`LeaseSigner`).
                audited = self.bans.audited(ledger, leased, members)
                signed = self._tickets.signed(audited, members)
                ledger.pushed_as(signed)  # a late receipt is adopted only under its lease's run
                return Lease(ledger.step, signed, routes)
        return Lease(newest, [], routes)

    def _open_next_early(self) -> None:
        """delayed_update: the next step opens before this one completes (`live_steps`)."""
        step = self._window.early()
        if step is not None:
            self._open(step, beside=True)

    def _maybe_commit(self, ledger: StepLedger) -> None:
        """Start committing `ledger`'s step once it is complete, unless a commit of it runs
        already or (delayed_update) the step before it is not applied yet: its commit starts
        when that one's ends. With delayed_update the next step opens beside it now."""
        live = self._window.at(ledger.step)
        if live is None or live.ledger is not ledger or live.commit.applied:
            return
        if ledger.complete and live is self._window.newest:
            self._records.blocked(ledger.step)  # until the next step opens
        if not ledger.complete or live.commit.task is not None or self._window.oldest is not live:
            return
        live.commit.task = asyncio.create_task(self._commit_step(live))
        beside = self._window.beside(ledger)
        if beside is not None:
            self._open(beside, beside=True)

    async def report(self, trainer: str, result: MicrobatchResult) -> None:
        live = self._window.at(result.step)
        if not self._window.speaks_for(trainer, result.step, result.index):
            # Any token holder may report: its word on a microbatch whose lease is another's
            # (its holders, its loss, its audit's verdicts) is not taken, its step live or
            # committed (an audit's own report comes after); what it says landed is looked for
            # in the members' receipts (`StepLedger.speaks_for`, `recheck`).
            self._rated.warning(
                "not-its-lease",
                "trainer %s reported microbatch (%d, %d), whose lease is not its own (or of a "
                "step long past): its word is not taken, the replicas' receipts of it are "
                "looked at instead",
                trainer,
                result.step,
                result.index,
            )
            if live is not None and not result.late:
                live.ledger.recheck(result.index)
                self._wake()  # leasable again once its receipts were looked at
            return
        if await self.bans.screen(trainer, result, live.ledger if live else None):
            self._wake()  # it rests on a banned peer's answer: it goes out again
            return
        if result.late:  # an audit's own report: its verdicts acted on, no work of its own
            return
        self.trainers_failure = None  # a microbatch went through
        if live is None or live.commit.applied:
            return
        ledger = live.ledger
        free = ledger.leasable()
        extras = ledger.report(
            trainer,
            result.step,
            result.index,
            result.holders,
            result.loss_sum,
            result.samples,
            result.chain,
            result.back,
        )
        # Waiting leases look again only for something new: work given back (a stage left out,
        # to adopt or replay) or a complete step; waking them on every report would cost each
        # report a lease computation per waiting trainer.
        if ledger.complete or ledger.leasable() > free:
            self._wake()
        # Before the voids below await: a call cancelled there leaves no complete ledger uncommitted
        self._maybe_commit(ledger)
        for extra in extras:  # another run's gradient was accepted first: void this one
            await self.voids.straggler(ledger, extra.stage, extra.peer, result.index, trainer)

    async def report_and_lease(
        self,
        trainer: str,
        results: Sequence[MicrobatchResult],
        count: int,
        *,
        working: Sequence[Working],
    ) -> Lease:
        for result in results:
            await self.report(trainer, result)
        return await self.lease(trainer, count, working=working)

    async def release(
        self, trainer: str, indices: Sequence[int], failure: str | None = None
    ) -> None:
        """A trainer gave these microbatches back (a hop failed on every replica it tried,
        `failure` says how): look at the members, since one may be dead or restarted empty.
        (Indices only: with delayed_update, the live step that leased them to `trainer`.)"""
        ledgers = [live.ledger for live in self._window.working()]
        # a lessee's failure (or its lease's last holder's, run out): what a stalled job's
        # status names as its cause; anyone else's is not taken
        if failure and any(ledger.speaks_for(trainer, i) for ledger in ledgers for i in indices):
            self.trainers_failure = failure
        for ledger in ledgers:
            ledger.release(trainer, indices)
        if ledgers:
            self._wake()
            if self._window.committing():
                # A commit checks the members itself; during its APPLY those that applied are
                # at the next step already, and would be dropped as if restarted.
                return
            now = self.clock.now()
            if now - self._checked >= self._CHECK_EVERY_S:
                self._checked = now
                await self.membership.check(ledgers[0].step)

    # -- the step -------------------------------------------------------------------------------
    async def _commit_step(self, live: Live) -> bool:
        commit, ledger = live.commit, live.ledger
        if live not in self._window:
            return False  # a rollback or an earlier commit moved on: this ledger is history
        if ledger.step >= self.steps:  # the final evaluation: nothing to commit
            commit.applied = True
            await self._next_step(live, 0)
            return True
        try:
            rid = f"{ledger.step}/{commit.attempt}{self._rollback.epoch}"  # anew after rollbacks
            decided = functools.partial(self._decided, live)  # the next step may open then
            async with self.two_phase.attempt(ledger, rid, decided) as applied:
                if applied:  # a round that ends with the step ends now, within the attempt
                    await self.rounds.applied(ledger)
            if applied:
                commit.applied = True
                await self._next_step(live, commit.attempt)
                return True
            failure = self.two_phase.failure
            if failure is not None:
                # A round that only voided replicas past the norm bound is not counted: each
                # is voided so at most once a step (`trust.round_checks`), and one owner's word
                # must not spend two of the step's rounds on every honest sender it names.
                commit.failed_rounds += 0 if failure.voided_only else 1
                if self.on_status and failure.left_out:
                    await _maybe_await(self.on_status(failure.status(ledger.step)))
                bound = self.job.runtime.max_commit_rounds
                if commit.failed_rounds >= bound:
                    raise CommitStalled(
                        f"step {ledger.step}: {commit.failed_rounds} averaging rounds failed "
                        f"without a commit (runtime.max_commit_rounds = {bound}); the last: "
                        f"{failure.reason}"
                    )
        except asyncio.CancelledError:
            raise
        except CommitStalled as e:  # every retry is bounded: say why, rather than spin
            log.error("%s", e)
            self._fail(e)
            return False
        except NonFiniteStep as e:  # a retry would meet the same gradient: fail, loudly
            saved = self.recovery.latest()
            last = f"the last is the checkpoint of step {saved}" if saved else "none was written"
            error = NonFiniteStep(f"{e}. No checkpoint holds it ({last})")
            log.error("job %s: %s", self.job_id, error)
            self._fail(error)
            return False
        except Exception as e:  # a bug: fail the job loudly rather than hang
            log.exception("step %d: commit failed", ledger.step)
            self._fail(e)
            return False
        if live in self._window:
            commit.task = None
            commit.attempt += 1
            if ledger.complete:
                # Nothing was lost (a member without gradients left, or no stage has a replica
                # yet): no replay will report back, so try again by itself, backing off.
                commit.task = asyncio.create_task(self._retry(live, commit.backoff))
        return False

    def _decided(self, live: Live) -> None:
        """`live`'s step is decided (its APPLYs sent): the plain synchronous rule opens the next
        step beside it now (`live_steps.SyncSteps`); `_next_step` finishes the step once its
        APPLYs answered, as it does with delayed_update's next step open beside."""
        step = self._window.decided(live.ledger)
        if step is not None and live in self._window:
            self._open(step, beside=True)

    def _fail(self, error: BaseException) -> None:
        self.error = error
        self.finished.set()

    async def _retry(self, live: Live, backoff: Backoff) -> bool:
        await backoff.sleep()
        return await self._commit_step(live)

    async def _next_step(self, live: Live, attempt: int) -> None:
        """After `live`'s step is applied: bring new replicas in, checkpoint, open the next
        (with delayed_update it is open already: its commit may start now)."""
        ledger = live.ledger
        record = self._records.applied(ledger, live.started, self.two_phase.grad_norm)
        # audits of the step before's contributions still waiting for digests: their bound
        await self.bans.settle(ledger.step)
        step = ledger.step + 1
        if not ledger.microbatches:  # the final evaluation: the job is done
            self._open(step)
            if self.on_step:
                await _maybe_await(self.on_step(self._records.with_blocked(record)))
            return
        await self.membership.sync(step)
        due = self.recovery.due(step)
        if due or self.membership.copying():  # they need every member's state whole
            await self.rounds.whole(step)
        if due:
            self.recovery.checkpoint(step, self.replicas())
        if live in self._window and len(self._window) > 1:
            # delayed_update: the next step's commit waits for this one; before it starts (it
            # may right away), replicas that copied a member join it.
            await self.membership.admit_copies(step)
        if live in self._window:  # not rolled back meanwhile
            self._window.remove(live)
            oldest = self._window.oldest
            if oldest is not None:  # delayed_update: the next step, which waited for this APPLY
                self._maybe_commit(oldest.ledger)
                self._open_next_early()
            else:
                self._open(step)
                if self.rounds.admit_on_open(step):
                    await self.membership.admit_copies(step)
        if attempt:
            log.info("step %d committed after %d failed rounds", ledger.step, attempt)
        if self.on_step:
            await _maybe_await(self.on_step(self._records.with_blocked(record)))

    async def flush(self) -> None:
        """Wait until the checkpoint being written, if any, is sealed or skipped."""
        await self.recovery.flush()


def _barred(members: Members, standing: Standing) -> Callable[[list[int]], dict[int, list[str]]]:
    """Of some stages, the servers on them (the registry's `members`) that are banned from the
    job, by stage: why a stage served by them has no replica all the same."""

    def barred(stages: list[int]) -> dict[int, list[str]]:
        on = members()
        return {k: [r.peer for r in on[k] if standing.bars(r.peer)] for k in stages if k < len(on)}

    return barred
