"""A replica's part of committing a step (docs/architecture.md, "Commit"): PREPARE checks that it
holds exactly the step's receipts, sums its gradients and averages them with the round's group
(butterfly all-reduce, `stage_server.averaging`); APPLY takes one optimizer step with the pool's
average; Discard voids the step's gradients here, to be replayed elsewhere.

Why the pieces sit as they do:
- Every touch of the runtime runs on the replica's worker (`stage_server.replica.worker`), between
  its Forwards and Backwards: a late Backward must not reach the sums being averaged.
- A PREPARE that fails before averaging (a stale or short ledger) aborts its round in the averager
  at once, so the group learns it now rather than when the round times out.
- Every replica of a pool applies the same sums with the same scale, so replicas stay bitwise
  identical; a retried commit of an applied step changes nothing (`already`).
- Error feedback (`stage_server.averaging.error_feedback`): a lossy averaging codec's dropped
  precision is carried to the next step's round. A round's residuals count only once its step
  applies here, and a stage installed anew (`serve`) starts from none.
- Clipping needs the whole model's norm, so a clipped job commits in two phases: PREPARE reports
  this stage's squared norm, APPLY brings the coordinator's coefficient.
- A NaN or infinite average is never applied, clipping or not (`NonFiniteGradient`): PREPARE
  reports its norm as it is, for the coordinator to fail the job on, and APPLY refuses it. The
  check reuses the norm PREPARE took, so a clean step costs no extra pass over the gradient.
  A round's end (`pool.mode = "local"`) refuses a NaN or infinite pool sum in its PREPARE, before
  it is kept or applied (an eager round's sums and the members' mean alike).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from stage_server.averaging.butterfly import RoundSettings, all_reduce
from stage_server.averaging.channels import ChannelPool
from stage_server.averaging.checksum import AuditedChecks, PartChecks
from stage_server.averaging.error_feedback import ErrorFeedback
from stage_server.averaging.flat import flatten, unflatten
from stage_server.averaging.hostile import answered_norm, misreport, poison
from stage_server.averaging.owner import Averager, AveragingAborted
from stage_server.averaging.sent_sums import SentSum
from stage_server.averaging.spill import Spill
from stage_server.peer.metrics import StageMetrics
from stage_server.replica.messages import Limits
from stage_server.replica.pending_apply import PendingApply
from stage_server.replica.runtime import Served, StageRuntime
from stage_server.replica.step_sums import Sent
from stage_server.replica.tensor_checks import all_finite
from stage_server.replica.worker import Worker
from swarm.device.oom import OutOfDeviceMemory, inject, is_out_of_memory, oom_message
from swarm.errors import FailedPrecondition, InvalidArgument, NonFiniteGradient, WireError
from swarm.job.rule import EagerOp
from swarm.net.round_tickets import RoundPass
from swarm.ops import allocator
from swarm.ops.faults import Point, maybe_die
from swarm.policy.parts import EQUAL_PARTS, Parts
from swarm.proto import stage_pb2 as pb
from swarm.wire import codec

__all__ = ["Commit", "Committed", "Committer"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Commit:
    """One Commit call, decoded."""

    job: str
    stage: int
    step: int
    prepare: bool  # check the receipts, sum (and average) the gradients, keep them for apply
    apply: bool  # apply the prepared average: one optimizer step
    microbatches: list[int]  # the step's microbatches this replica must hold receipts of
    total_samples: int  # the step's samples over the whole pool (the average's divisor)
    group: list[str]  # the replicas averaging this round (addresses); one: no averaging
    group_index: int  # this replica's place in `group`
    round: str  # the round's id: a retried prepare of a step is another round
    grad_scale: float = 1.0  # the clipping coefficient APPLY multiplies the gradient by
    # pool.mode = "local": the round ending before `step`, not a step
    # (`stage_server.replica.local_round`)
    round_end: bool = False
    eager: int = EagerOp.NONE  # pool.overlap = "eager": what the round's end asks (`EagerOp`)
    # the round's parts (`swarm.policy.parts.Parts`): one weight per member of `group`, and how
    # many of its first members contribute (the rest are aggregators)
    parts: Parts = EQUAL_PARTS
    check_seed: int = 0  # the checksum of every part asked (0: none)
    # other contributors' contributions audited: the same checksums, a seed each
    audit_seeds: tuple[int, ...] = ()
    # the scheduler's round ticket: what proves this replica a member to the round's owners
    # (`swarm.net.round_tickets`); None: a pool its owner coordinates
    proof: RoundPass | None = None

    @classmethod
    def of(cls, request: pb.StageCommitRequest) -> Commit:
        """`request` decoded (its route is the caller's to check)."""
        return cls(
            job=request.job,
            stage=request.stage,
            step=request.step,
            prepare=request.phase in (pb.COMMIT_PHASE_BOTH, pb.COMMIT_PHASE_PREPARE),
            apply=request.phase in (pb.COMMIT_PHASE_BOTH, pb.COMMIT_PHASE_APPLY),
            microbatches=list(request.microbatches),
            total_samples=request.total_samples,
            group=list(request.group),
            group_index=request.group_index,
            round=request.round,
            grad_scale=request.grad_scale if request.HasField("grad_scale") else 1.0,
            round_end=request.round_end,
            eager=request.eager,
            parts=Parts(request.part_weights, request.contributors),
            check_seed=request.check_seed,
            audit_seeds=tuple(request.audit_seeds),
            proof=RoundPass.of(
                request.round_ticket if request.HasField("round_ticket") else None,
                request.group_peers,
            ),
        )


@dataclass(frozen=True)
class Committed:
    """The replica after a Commit: its step, whether the step was applied before (a retry), and
    the squared norm of the prepared average (0.0 when nothing was prepared), and the checksums
    of every part it averaged (`checksum`; asked by the coordinator's seed)."""

    step: int
    already: bool = False
    grad_sq_norm: float = 0.0
    sum_checks: tuple[pb.SumCheck, ...] = ()
    audit_checks: tuple[pb.SumCheck, ...] = ()  # with `audit_seeds` (`AuditedChecks`)


class Committer:
    """Commits and discards of one replica, on the stage `runtime()` serves (read anew at each
    call and before averaging: a stage released meanwhile is NOT_FOUND, not averaged). `averager`
    and `channels` are its pool's averaging (served to the group by `PoolServicer`, dialled by
    `all_reduce`), `limits` the served job's chunking and codec blocks."""

    def __init__(
        self,
        *,
        peer: str,
        worker: Worker,
        metrics: StageMetrics,
        averager: Averager,
        channels: ChannelPool,
        limits: Limits,
        runtime: Served,
        spill_dir: Path | None = None,
    ) -> None:
        self.peer, self._worker, self.metrics, self._runtime = peer, worker, metrics, runtime
        self.averager, self.channels, self.limits = averager, channels, limits
        self.spill_dir = spill_dir  # where a PREPARE keeps the sums it overwrites (None: memory)
        self.feedback = ErrorFeedback()  # what lossy averaging dropped, for the next round
        # (job, stage, step, squared norm) of the average this replica prepared last
        self._prepared: tuple[str, int, int, float] | None = None
        # the runtime's `loads` as it answered that PREPARE: a state loaded since (a rollback's
        # to that very step, say) leaves `_prepared` on record, but no APPLY of it will come
        self._prepared_loads = -1
        # (round, its sum as a lossy codec carried it) of the last round averaged while a peer
        # follows this replica: what the update sent to it is made of (`SentSum`)
        self._sent: tuple[str, Sent] = ("", ())
        self.pending = PendingApply()  # calls of the next step, waiting for this one's APPLY

    def serve(self) -> None:
        """A stage installed anew (or the one served let go) starts from no residuals, and
        holds no sum of the last stage's round (its bytes in the codec, a quarter of the
        gradient's in int8): round ids name a step, not a stage."""
        self.feedback = ErrorFeedback()
        self._prepared = None
        self._sent = ("", ())
        self.pending.moved()

    async def before(self, step: int) -> None:
        """A data-plane call of `step` is about to compute here: while this replica answered
        the PREPARE of the step before and its APPLY has not landed, it waits for that APPLY
        (`pending_apply`: the coordinator opens a step once the one before is decided). Not
        under delayed_update, whose next step computes on the parameters before the APPLY."""

        def due() -> bool:
            rt, prepared = self._runtime(), self._prepared
            return (
                prepared is not None
                and prepared[1:3] == (rt.stage, step - 1)
                and rt.step == step - 1
                and rt.loads == self._prepared_loads
                and not rt.copies.ahead
            )

        if due():
            timeout_s = self._runtime().job.runtime.rpc_timeout_s  # the APPLY call's deadline
            await self.pending.wait(due, timeout_s, f"{self.peer}: a call of step {step}")

    async def commit(self, c: Commit) -> Committed:
        """Prepare and/or apply step `c.step` (or, `c.round_end`, the round ending before it)."""
        if c.round_end:
            return await self._round_end(c)
        if c.eager != EagerOp.NONE:
            raise InvalidArgument("an eager operation is a round's end: round_end must be set")
        rt, step, already, sq_norm = self._runtime(), c.step, False, 0.0
        checks: PartChecks | None = None
        if c.prepare and c.apply and rt.job.training.grad_clip > 0:
            raise FailedPrecondition(
                "training.grad_clip needs the whole model's gradient norm: the coordinator "
                "commits such a job in two phases (PREPARE, then APPLY)"
            )
        if c.prepare:
            if step < rt.step:
                return Committed(rt.step, already=True)
            # Another replica's work of `step` may be audited here after the update, though the
            # routes sent this replica none of it: as an auditor of the step's contributions
            # (`audit_seeds`), or of answers, wherever the group holds a second replica (an
            # aggregator in it holds no model). Its parameters are kept for those late
            # re-executions, which it would refuse as stale otherwise (`prior_params`).
            if c.audit_seeds:  # the coordinator drew audits here: whatever the job says
                rt.copies.recorded(step)
            elif (c.parts.contributors or len(c.group)) > 1:  # where the job audits
                rt.copies.pooled(step)
            self._prepared = None
            checks = _checks(c)
            if len(c.group) <= 1:  # alone: nothing to average, the whole PREPARE in one call
                sq_norm = await self._prepare_alone(c, rt)
            else:
                held = (step, c.microbatches, c.total_samples)
                sums = await self._part(c, rt.prepare, *held, spilled=step, checks=checks)
                sent = self._sent[1] if self._sent[0] == c.round else ()
                await self._worker.run(rt.set_prepared, step, sums, c.total_samples, sent)
                sq_norm = await self._worker.run(rt.prepared_sq_norm, step)
            self._prepared = (c.job, c.stage, step, sq_norm)
            self._prepared_loads = rt.loads
            if not math.isfinite(sq_norm):
                self.metrics.nonfinite()
                log.warning(
                    "%s: stage %d step %d: the pool's averaged gradient is not finite (squared "
                    "norm %s): it will not be applied",
                    self.peer,
                    c.stage,
                    step,
                    sq_norm,
                )
        if c.apply:
            if not 0.0 < c.grad_scale <= 1.0:
                raise InvalidArgument(f"grad_scale must be in (0, 1]; got {c.grad_scale}")
            known = self._prepared
            norm = known[3] if known is not None and known[:3] == (c.job, c.stage, step) else None
            try:
                already = await self._worker.run(self._apply, rt, c, norm)
            finally:
                self.pending.moved()  # calls of the next step waiting for it go on (or refused)
            self.feedback.applied(c.job, c.stage, step)
            if not already:
                log.debug("%s: stage %d committed step %d", self.peer, c.stage, step)
            self.metrics.committed(rt.step, applied=not already)
        answered = answered_norm(sq_norm, step) if c.prepare else sq_norm  # a fault's lie
        return Committed(rt.step, already, answered, *_report(checks, c))

    async def _prepare_alone(self, c: Commit, rt: StageRuntime) -> float:
        """PREPARE of a replica alone in its round (a pool of one: nothing to average): its
        sums prepared as they are, their squared norm. One call on the worker, not four
        (`_part`'s two, the keeping and the norm): each is a hand-off from the event loop to the
        worker and back, and the commit is the part of a step where every stage waits (issue
        69). A stale or short ledger tells the averager at once, as `_part` does."""
        sent = self._sent[1] if self._sent[0] == c.round else ()  # no round averaged: as before

        def prepare() -> float:
            allocator.give_back(sum(p.nbytes for p in rt.params))  # as `_part`: before the peak
            sums = rt.prepare(c.step, c.microbatches, c.total_samples)
            rt.set_prepared(c.step, sums, c.total_samples, sent)
            return rt.prepared_sq_norm(c.step)

        try:
            return await self._worker.run(prepare)
        except WireError as e:
            self.averager.abort((c.job, c.stage, c.round), str(e))
            raise

    async def _round_end(self, c: Commit) -> Committed:
        """pool.mode = "local": PREPARE averages the pool's pseudo-gradients, weighted by each
        replica's samples in the round; APPLY takes the outer step every replica takes."""
        checks = _checks(c)
        if c.eager != EagerOp.NONE:
            return await self._eager(c, checks)
        rt, boundary, already = self._runtime(), c.step, False
        rnd = rt.round  # the replica's round (`stage_server.replica.no_round`)
        if c.prepare:
            if await self._worker.run(rnd.ended, boundary):
                return Committed(rt.step, already=True)
            if c.total_samples < 0:
                raise InvalidArgument(f"total_samples must be >= 0; got {c.total_samples}")
            sums = await self._part(c, rnd.prepare, boundary, fresh=True, checks=checks)
            await self._worker.run(self._finite, c, "averaged pseudo-gradient", sums)
            await self._worker.run(rnd.set_prepared, boundary, sums, c.total_samples)
        if c.apply:
            already = await self._worker.run(rnd.apply, boundary)
            self.feedback.applied(c.job, c.stage, boundary)
            if not already:
                log.debug("%s: stage %d ended a round at step %d", self.peer, c.stage, boundary)
        return Committed(rt.step, already, 0.0, *_report(checks, c))

    async def _eager(self, c: Commit, checks: PartChecks | None) -> Committed:
        """pool.overlap = "eager" (`stage_server.replica.eager_round`): the operation `c.eager`
        names, in the phase it belongs to."""
        rt, boundary, already = self._runtime(), c.step, False
        rnd = rt.round  # the replica's round (`stage_server.replica.no_round`)
        if c.eager == EagerOp.STEP and c.apply and not c.prepare:
            already = await self._worker.run(rnd.eager_step, boundary, self._samples(c))
        elif c.eager == EagerOp.AVERAGE and c.prepare and not c.apply:
            sums = await self._part(c, rnd.eager_part, boundary, checks=checks)
            await self._worker.run(self._finite, c, "sum of the shares", sums)
            await self._worker.run(rnd.set_average, boundary, sums)
            self.feedback.applied(c.job, c.stage, boundary)
        elif c.eager == EagerOp.LAST and c.prepare and not c.apply:
            if await self._worker.run(rnd.ended, boundary):
                return Committed(rt.step, already=True)
            total = self._samples(c)
            sums = await self._part(c, rnd.last_part, boundary, total, fresh=True, checks=checks)
            await self._worker.run(self._finite, c, "sum of the last shares", sums)
            await self._worker.run(rnd.set_last, boundary, sums, total)
        elif c.eager == EagerOp.LAST and c.apply and not c.prepare:
            already = await self._worker.run(rnd.last_step, boundary)
            self.feedback.applied(c.job, c.stage, boundary)
        elif c.eager == EagerOp.MEAN and c.prepare and not c.apply:
            sums = await self._part(c, rnd.mean_part, boundary, lossless=True, checks=checks)
            await self._worker.run(self._finite, c, "sum of the members' starts", sums)
            members = c.parts.contributors or len(c.group)  # aggregators hold no model: not in it
            await self._worker.run(rnd.set_mean, sums, members)
        else:
            raise InvalidArgument(
                f'pool.overlap = "eager": no operation {c.eager} in phase '
                f"{'PREPARE' if c.prepare else ''}{'+' if c.prepare and c.apply else ''}"
                f"{'APPLY' if c.apply else ''}"
            )
        if not already:
            log.debug(
                "%s: stage %d: %s of the round ending at step %d",
                self.peer,
                c.stage,
                EagerOp(c.eager).name,
                boundary,
            )
        return Committed(rt.step, already, 0.0, *_report(checks, c))

    def _finite(self, c: Commit, what: str, sums: list[torch.Tensor]) -> None:
        """On the worker: refuse a round's pool sum that holds NaN or infinity, before anything
        of it is kept or applied (`NonFiniteGradient`: the coordinator fails the job)."""
        if all_finite(sums):
            return
        self.metrics.nonfinite()
        raise NonFiniteGradient(
            f"stage {c.stage}: the round ending at step {c.step}: the pool's {what} is NaN or "
            "infinite: refused, nothing of it applied"
        )

    @staticmethod
    def _samples(c: Commit) -> int:
        if c.total_samples < 0:
            raise InvalidArgument(f"total_samples must be >= 0; got {c.total_samples}")
        return c.total_samples

    async def _part(
        self,
        c: Commit,
        prepare: Callable[..., list[torch.Tensor]],
        *args: object,
        lossless: bool = False,
        fresh: bool = False,
        spilled: int | None = None,
        checks: PartChecks | None = None,
    ) -> list[torch.Tensor]:
        """This replica's part (`prepare(*args)` on the worker), summed with `c.group`'s (with
        the job's averaging codec unless `lossless`). A PREPARE that fails before averaging
        tells the pool now, not when its round times out.

        The sum lands over the part itself, in place, where nothing else reads the part: when
        `prepare` made it `fresh` for this call, or when it is the lent sums of step `spilled`
        (the runtime's `Spill` keeps what is overwritten, for a retry or a straggler). `checks`
        takes the checksums of every part."""
        # The replica's peak comes now: what its arenas freed since the last commit goes back
        # first (`swarm.ops.allocator`), on the worker, which is idle until this commit is done;
        # not when the freed memory dwarfs the state the commit adds (a small stage's activations).
        state = sum(p.nbytes for p in self._runtime().params)
        await self._worker.run(allocator.give_back, state)
        try:
            sums = await self._worker.run(prepare, *args)
        except WireError as e:
            self.averager.abort((c.job, c.stage, c.round), str(e))
            raise
        if len(c.group) <= 1:  # alone: nothing to average
            return sums
        spill = None
        if spilled is not None:
            spill = await self._worker.run(self._runtime().sums.spill, spilled, self.spill_dir)
        try:
            in_place = fresh or spilled is not None
            return await self._average(c, sums, lossless, in_place, spill, checks)
        except AveragingAborted:
            raise  # the round's own doing: it was aborted, naming whom it failed on
        except Exception as e:  # this replica failed its part (out of memory, say): its group
            self.averager.abort(  # learns it now, naming it, rather than at its timeout
                (c.job, c.stage, c.round), f"{self.peer} failed: {e}", [c.group_index]
            )
            if not is_out_of_memory(e):
                raise
            rt, nbytes = self._runtime(), sum(t.nbytes for t in sums)
            what = f"averaging (round {c.round!r}, step {c.step})"
            raise OutOfDeviceMemory(
                oom_message(rt.job.name, c.stage, what, rt.device, e, nbytes=nbytes)
            ) from e

    def _apply(self, rt: StageRuntime, c: Commit, sq_norm: float | None) -> bool:
        """On the worker: apply the prepared step unless its gradient is NaN or infinite
        (`sq_norm`: its squared norm as PREPARE took it here, None when unknown)."""
        if c.step >= rt.step:  # not a retry of a step applied already
            # What the averaging's buffers freed goes back before the optimizer's own pass
            # (and the next step's compute) peaks on top of it.
            allocator.give_back(sum(p.nbytes for p in rt.params))
            if sq_norm is None:  # not prepared by a Commit seen here (or not at all)
                sq_norm = rt.prepared_sq_norm(c.step)  # not prepared: FailedPrecondition
                if not math.isfinite(sq_norm):
                    self.metrics.nonfinite()
            if not math.isfinite(sq_norm):
                raise NonFiniteGradient(
                    f"stage {c.stage} step {c.step}: the prepared gradient is NaN or infinite "
                    f"(squared norm {sq_norm}): not applied, whatever grad_scale says"
                )
        return rt.apply(c.step, c.grad_scale)

    async def _average(
        self,
        c: Commit,
        sums: list[torch.Tensor],
        lossless: bool,
        in_place: bool,
        spill: Spill | None,
        checks: PartChecks | None = None,
    ) -> list[torch.Tensor]:
        """The pool's summed gradient: butterfly all-reduce with the round's group, over `sums`
        themselves when `in_place` (`spill`, if any, keeps what it overwrites of them)."""
        rt = self._runtime()
        if not 0 <= c.group_index < len(c.group):
            raise InvalidArgument(f"group_index {c.group_index} outside the group")
        start = time.perf_counter()
        maybe_die(Point.AVERAGING, c.step)
        inject(Point.AVERAGING_OOM, c.step, self.peer)  # before this replica sends a byte
        flat = flatten(sums)  # a view of the part (or, of tensors apart, a copy of it)
        n = len(c.group)
        # Only where a hostile fault is armed (tests); the parts as the butterfly cuts them.
        poison(flat, self.averager, c.step, c.parts.bounds(flat.numel(), n), c.group_index)
        keep = None
        if spill is not None:

            async def keep(where: slice) -> None:  # a slice's write, off the event loop
                await asyncio.to_thread(spill.keep, where)

        averaged = codec.codec_from_name("none" if lossless else rt.job.compression.averaging)
        # A peer follows this replica: what it is sent of the sum is what the codec carried.
        sent = SentSum() if averaged != codec.CODEC_NONE and rt.updates.followed else None
        residuals = None
        if rt.job.compression.error_feedback and averaged != codec.CODEC_NONE:  # a lossy one only
            residuals = self.feedback.start(c.job, c.stage, c.step, flat)
        settings = RoundSettings(
            group=list(c.group),
            index=c.group_index,
            round=c.round,
            job=c.job,
            stage=c.stage,
            codec=averaged,
            block_size=self.limits.block_size,
            timeout_s=rt.job.runtime.averaging_timeout_s,
            chunk_bytes=self.limits.chunk_bytes,
            max_bytes=self.limits.max_bytes,
            in_place=in_place,
            parts=c.parts,
            proof=c.proof,
        )
        total = await all_reduce(
            flat,
            settings,
            averager=self.averager,
            channels=self.channels,
            residuals=residuals,
            on_bytes=self.metrics.averaged,
            keep=keep,
            checks=checks,
            on_sum=sent,
        )
        if sent is not None:
            self._sent = (c.round, sent.whole(flat.numel()))
        self.metrics.averaging_seconds(time.perf_counter() - start)
        if residuals is not None:
            self.feedback.prepared(c.job, c.stage, c.step, residuals)
        return unflatten(total, sums)

    async def discard(self, step: int) -> int:
        """Void this replica's gradients of `step`; how many microbatches were dropped."""
        dropped = await self._worker.run(self._runtime().discard, step)
        if self._prepared is not None and self._prepared[2] == step:
            self._prepared = None  # what it prepared is gone with its gradients
            self.pending.moved()  # no APPLY of it will come: a call waiting for one is refused
        log.warning("%s: voided %d microbatches of step %d", self.peer, dropped, step)
        self.metrics.accumulated(0, 0)
        return dropped


def _checks(c: Commit) -> PartChecks | None:
    """The checksums of every part a PREPARE is asked for (`checksum`), if any: with
    `audit_seeds`, the same with each of those (`AuditedChecks`)."""
    if not c.check_seed or not c.prepare:
        return None
    if c.audit_seeds:
        return AuditedChecks(c.check_seed, c.audit_seeds)
    return PartChecks(c.check_seed)


def _report(
    checks: PartChecks | None, c: Commit
) -> tuple[tuple[pb.SumCheck, ...], tuple[pb.SumCheck, ...]]:
    """The checksums asked for, and those of the audits' seeds (as a hostile fault armed in
    tests would have them said: `misreport`)."""
    if checks is None:
        return (), ()
    audit = checks.audit_report() if isinstance(checks, AuditedChecks) else []
    own = c.group_index
    return misreport(checks.report(), own, c.step), misreport(audit, own, c.step)
