"""The step coordinator: leases each step's microbatches to trainers, collects where their
gradients live, and commits the step on every replica of every stage in two phases.

`LocalCoordinator` runs in the process that owns the job's step: the scheduler (for its embedded
trainer and, over gRPC, remote trainers) or a standalone `swarm trainer --stage-servers`. Commit:
  1. replicas that left (or hold a gradient they must not count) are *lost*: the ledger re-needs
     their microbatches at their stage, and trainers replay them;
  2. PREPARE on every replica of every stage at once: each checks its receipts and averages with
     its pool (butterfly all-reduce); a replica that fails is lost, and the step waits for replays;
  3. APPLY everywhere: one optimizer step. No stage leaves step t before every pool has averaged,
     so a replay can still run through the whole pipeline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from prometheus_client import CollectorRegistry

from scheduler.coordinator.ledger import StepLedger
from swarm import checkpoint, stage_state
from swarm.config import JobConfig
from swarm.errors import SwarmError
from swarm.lease import Lease, MicrobatchResult, Replica
from swarm.metrics import CoordinatorMetrics
from swarm.progress import StepRecord
from swarm.proto import stage_pb2 as pb
from swarm.stage_client import StageClient

__all__ = ["LocalCoordinator"]

log = logging.getLogger(__name__)
# Codes that mean the replica is gone (dead, partitioned, or another process now): not a refusal.
_GONE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.NOT_FOUND,
    }
)


@dataclass
class _Commit:
    attempt: int = 0
    task: asyncio.Task[bool] | None = None  # set from the first attempt until the next step opens
    applied: bool = False  # the step is committed: late reports and releases for it are moot


class LocalCoordinator:
    _RETRY_MAX_S = 2.0  # longest pause between commit attempts that wait on no replay
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
    ) -> None:
        self.job, self.job_id, self.members, self.token = job, job_id, members, token
        self.steps = steps if steps is not None else job.training.steps
        self.on_step = on_step
        self.ledger: StepLedger | None = None
        self._clients: dict[tuple[str, int, str], StageClient] = {}
        self._stage_of: dict[str, int] = {}  # where each member served when last seen
        self._commit = _Commit()
        self._step_started = time.perf_counter()
        self._synced: set[str] = set()
        self.checkpoint_dir, self.on_rollback = checkpoint_dir, on_rollback
        self._rollback: asyncio.Task[None] | None = None
        self._checked = 0.0
        self._join_backoff: dict[str, tuple[float, float]] = {}  # peer -> (retry at, delay)
        self.metrics = metrics or CoordinatorMetrics(job_id, CollectorRegistry())
        self.metrics.last_commit.set(time.time())
        self.finished = asyncio.Event()
        self.error: BaseException | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> int:
        """Bring every replica to one step (finishing a half-applied commit) and open it."""
        step = await self._reconcile()
        self._open(step)
        return step

    def _open(self, step: int) -> None:
        old = self._commit.task
        if old is not None and old is not asyncio.current_task():
            old.cancel()  # a retry of a ledger that is history now would void live replicas
        t = self.job.training
        if step >= self.steps:
            self.ledger = None
            self.finished.set()
            return
        self.ledger = StepLedger(
            step, t.microbatches_per_step, t.stages, self.job.runtime.lease_timeout_s
        )
        self._commit, self._step_started = _Commit(), time.perf_counter()

    async def close(self) -> None:
        for task in (self._commit.task, self._rollback):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(c.close() for c in self._clients.values()))

    def client(self, stage: int, replica: Replica) -> StageClient:
        # Per stage (a peer moved by rebalancing serves another) and address (a peer restarted
        # under its name listens elsewhere). Few peers restart often enough for the old
        # clients to matter; `close` closes them all.
        key = (replica.peer, stage, replica.address)
        if key not in self._clients:
            self._clients[key] = StageClient(
                replica.address, self.job, self.job_id, stage, self.token
            )
        return self._clients[key]

    # -- trainers -------------------------------------------------------------------------------
    async def lease(self, trainer: str, count: int) -> Lease:
        if self.error:
            raise self.error
        ledger, members = self.ledger, self.replicas()
        if ledger is None:
            return Lease(self.steps, [], members, done=True)
        if any(not stage for stage in members):
            self._maybe_roll_back()
            return Lease(ledger.step, [], members)  # no work while a stage has no replica
        tasks = [] if self._commit.task else ledger.lease(trainer, count)
        return Lease(ledger.step, tasks, members)

    async def report(self, trainer: str, result: MicrobatchResult) -> None:
        ledger = self.ledger
        if ledger is None or self._commit.applied:
            return
        extras = ledger.report(
            trainer, result.step, result.index, result.holders, result.loss_sum, result.samples
        )
        if ledger.complete and self._commit.task is None:
            # Before the voids below await: a caller whose deadline cancels this call must not
            # leave a complete ledger with no commit.
            self._commit.task = asyncio.create_task(self._commit_step(ledger))
        for extra in extras:  # another trainer's gradient was accepted first: void this one
            await self._void(ledger, extra.stage, extra.peer)

    async def release(self, trainer: str, indices: Sequence[int]) -> None:
        """A trainer gave these microbatches back (a hop failed on every replica it tried):
        look at the members, since one may be dead or restarted empty."""
        if self.ledger and not self._commit.applied:
            self.ledger.release(trainer, indices)
            now = time.monotonic()
            if now - self._checked >= self._CHECK_EVERY_S:
                self._checked = now
                await self._check_members(self.ledger.step)

    async def _check_members(self, step: int) -> None:
        """Drop members that are gone or not at `step` (restarted empty at the same address)."""
        pairs = [(k, r) for k, stage in enumerate(self.replicas()) for r in stage]
        infos = await asyncio.gather(
            *(self.client(k, r).info() for k, r in pairs), return_exceptions=True
        )
        for (_, r), info in zip(pairs, infos, strict=True):
            if isinstance(info, BaseException) or info.step != step:
                self._drop(r.peer)

    # -- commit ---------------------------------------------------------------------------------
    async def _void(self, ledger: StepLedger, stage: int, peer: str) -> None:
        """`peer`'s gradients at `stage` must not count: replay them elsewhere, and tell it to
        drop them. A replica that cannot be reached is dropped from the members: if it comes
        back (restarted, empty), it copies a live replica at a step boundary."""
        lost = ledger.lose(peer, stage)
        self.metrics.replays.inc(len(lost))
        log.warning(
            "step %d: voiding %s's gradients at stage %d (replaying %s)",
            ledger.step,
            peer,
            stage,
            lost,
        )
        replica = next((r for r in self.replicas()[stage] if r.peer == peer), None)
        if replica is not None:
            try:
                await self.client(stage, replica).discard(ledger.step)
            except grpc.aio.AioRpcError as e:
                log.warning("discard on %s failed: %s", peer, e.details())
                if e.code() in _GONE:
                    self._drop(peer)

    def _drop(self, peer: str) -> None:
        """A replica that stopped answering: no more work or rounds until it rejoins."""
        if peer in self._synced:
            log.warning("replica %s is unreachable: leaving it out until it rejoins", peer)
            self._synced.discard(peer)
            self.metrics.dropped.inc()
            if self.ledger is not None:
                self.metrics.replays.inc(len(self.ledger.lose(peer)))

    async def _commit_step(self, ledger: StepLedger) -> bool:
        commit = self._commit
        if self.ledger is not ledger:
            return False  # a rollback or an earlier commit moved on: this ledger is history
        try:
            ok = await self._try_commit(ledger)
            if ok:
                commit.applied = True
                await self._next_step(ledger, commit.attempt)
                return True
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug: fail the job loudly rather than hang
            log.exception("step %d: commit failed", ledger.step)
            self.error = e
            self.finished.set()
            return False
        if self._commit is commit:
            commit.task = None
            commit.attempt += 1
            if ledger.complete and self.ledger is ledger:
                # Nothing was lost (a member without gradients left, or no stage has a replica
                # yet): no replay will report back, so try again by itself, backing off.
                commit.task = asyncio.create_task(self._retry(ledger))
        return False

    async def _next_step(self, ledger: StepLedger, attempt: int) -> None:
        """After `ledger`'s step is applied: bring new replicas in, checkpoint, open the next."""
        seconds = time.perf_counter() - self._step_started
        self.metrics.last_commit.set(time.time())
        record = StepRecord(ledger.step, ledger.loss(), ledger.samples(), seconds)
        await self._sync(ledger.step + 1)
        every = self.job.training.checkpoint_every
        if self.checkpoint_dir and every and (ledger.step + 1) % every == 0:
            try:
                await self._checkpoint(ledger.step + 1)
            except OSError as e:  # a full or broken disk: training goes on without this one
                log.error("checkpoint of step %d not written: %s", ledger.step + 1, e)
        self._open(ledger.step + 1)
        if attempt:
            log.info("step %d committed after %d failed rounds", ledger.step, attempt)
        if self.on_step:
            maybe = self.on_step(record)
            if maybe is not None:
                await maybe

    async def _retry(self, ledger: StepLedger) -> bool:
        await asyncio.sleep(min(self._RETRY_MAX_S, 0.05 * 2**self._commit.attempt))
        return await self._commit_step(ledger)

    async def _try_commit(self, ledger: StepLedger) -> bool:
        members, step = self.replicas(), ledger.step
        for stage, replicas in enumerate(members):
            alive = {r.peer for r in replicas}
            for peer in ledger.holdings(stage):
                if peer not in alive:
                    ledger.lose(peer, stage)
        if not ledger.complete or any(not replicas for replicas in members):
            return False  # trainers replay what was lost; report() commits again when complete
        # Receipts a replica holds beyond what the ledger accepted (a straggling trainer's, or a
        # failed microbatch's) would poison its pool's round: void that replica first.
        infos = await asyncio.gather(
            *(
                self.client(stage, r).info()
                for stage, replicas in enumerate(members)
                for r in replicas
            ),
            return_exceptions=True,
        )
        checked = [(stage, r) for stage, replicas in enumerate(members) for r in replicas]
        mismatched = False
        for (stage, r), info in zip(checked, infos, strict=True):
            if (isinstance(info, grpc.aio.AioRpcError) and info.code() in _GONE) or (
                not isinstance(info, BaseException) and info.step != step
            ):  # gone, or restarted empty at the same address: it rejoins at a boundary
                self._drop(r.peer)
                mismatched = True
            elif isinstance(info, BaseException) or list(info.receipts) != ledger.holdings(
                stage
            ).get(r.peer, []):
                await self._void(ledger, stage, r.peer)
                mismatched = True
        if mismatched:
            return False
        total, round_id = ledger.samples(), f"{step}/{self._commit.attempt}"
        calls, where = [], []
        for stage, replicas in enumerate(members):
            group = [r.address for r in replicas]
            holdings = ledger.holdings(stage)
            for index, replica in enumerate(replicas):
                calls.append(
                    self.client(stage, replica).commit(
                        step,
                        holdings.get(replica.peer, []),
                        total,
                        phase=pb.COMMIT_PHASE_PREPARE,
                        group=group,
                        group_index=index,
                        round=round_id,
                    )
                )
                where.append((stage, replica))
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [
            (stage, r, e)
            for (stage, r), e in zip(where, results, strict=True)
            if isinstance(e, BaseException)
        ]
        if failed:
            self.metrics.aborted_rounds.inc(len({stage for stage, _, _ in failed}))
            for stage, replica, error in failed:
                code = error.code() if isinstance(error, grpc.aio.AioRpcError) else None
                detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else error
                log.warning(
                    "step %d: round %s at stage %d failed on %s: %s",
                    step,
                    round_id,
                    stage,
                    replica.peer,
                    detail,
                )
                if code in _GONE:
                    self._drop(replica.peer)  # dead: its gradients are replayed
                elif code != grpc.StatusCode.ABORTED:
                    await self._void(ledger, stage, replica.peer)  # it holds what it must not
                # ABORTED: another member failed; this one's gradients are intact
            return False
        applied = await asyncio.gather(
            *(
                self.client(stage, replica).commit(step, [], total, phase=pb.COMMIT_PHASE_APPLY)
                for stage, replica in where
            ),
            return_exceptions=True,
        )
        for (stage, replica), result in zip(where, applied, strict=True):
            # Dead or hung after averaging: the next commit's check finds it a step behind and
            # leaves it out; it rejoins by copying a replica that applied.
            if isinstance(result, BaseException):
                log.warning(
                    "step %d: apply on %s (stage %d) failed: %s", step, replica.peer, stage, result
                )
        return True

    # -- checkpoints and rollback ---------------------------------------------------------------
    async def _checkpoint(self, step: int) -> None:
        """Save every stage's state at `step` (from one member each), then seal it."""
        assert self.checkpoint_dir is not None
        for stage, replicas in enumerate(self.replicas()):
            for r in replicas:  # the first member that answers
                try:
                    got, state = await self.client(stage, r).download_state(True, prefix="")
                except grpc.aio.AioRpcError as e:
                    log.warning("checkpoint %d: %s did not answer: %s", step, r.peer, e.code())
                    continue
                if got == step:
                    await asyncio.to_thread(
                        checkpoint.save_stage, self.checkpoint_dir, step, stage, state
                    )
                    break
            else:
                log.warning("checkpoint %d skipped: no replica of stage %d answered", step, stage)
                return
        await asyncio.to_thread(
            checkpoint.seal, self.checkpoint_dir, step, self.job.training.stages
        )
        log.info("checkpoint of step %d written to %s", step, self.checkpoint_dir)

    def _maybe_roll_back(self) -> None:
        """A stage has lost every replica. Once a replica of it is back, roll every stage back to
        the last complete checkpoint (no work can be exact without that stage's state)."""
        members = self.members()
        if self._rollback is None and all(members):
            self._rollback = asyncio.create_task(self._roll_back())

    async def _roll_back(self) -> None:
        try:
            step = checkpoint.latest(self.checkpoint_dir) if self.checkpoint_dir else None
            step = step or 0
            if self._commit.task:
                self._commit.task.cancel()
                self._commit.task = None
            loaded: set[str] = set()
            for stage, replicas in enumerate(self.members()):
                state = await asyncio.to_thread(self._stage_state, step, stage)
                for r in replicas:
                    try:
                        await self.client(stage, r).load_state(step, state)
                        loaded.add(r.peer)
                    except grpc.aio.AioRpcError as e:
                        log.warning(
                            "rollback: %s could not load step %d: %s", r.peer, step, e.details()
                        )
            self._synced = loaded
            if any(not stage for stage in self.replicas()):
                return  # not every stage could load it: the next lease tries again
            self.metrics.rollbacks.inc()
            log.warning("rolled every stage back to step %d", step)
            self._open(step)
            if self.on_rollback:
                maybe = self.on_rollback(step)
                if maybe is not None:
                    await maybe
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a damaged checkpoint, say: fail the job rather than retry forever
            log.exception("rollback failed")
            self.error = e
            self.finished.set()
        finally:
            self._rollback = None

    def _stage_state(self, step: int, stage: int) -> dict[str, torch.Tensor]:
        if step and self.checkpoint_dir:
            return checkpoint.load_stage(self.checkpoint_dir, step, stage)
        return stage_state.initial_state(self.job, stage)

    # -- membership ---------------------------------------------------------------------------
    def replicas(self) -> list[list[Replica]]:
        """Per stage, the members at the coordinator's step: trainers see and use only these."""
        members = self.members()
        for stage, replicas in enumerate(members):
            for r in replicas:
                before = self._stage_of.get(r.peer, stage)
                if before != stage:  # moved by rebalancing: a new replica of its new stage
                    log.info("%s moved from stage %d to %d", r.peer, before, stage)
                    self._synced.discard(r.peer)
                    if self.ledger is not None:  # what it held there is replayed
                        self.metrics.replays.inc(len(self.ledger.lose(r.peer, before)))
                self._stage_of[r.peer] = stage
        return [[r for r in stage if r.peer in self._synced] for stage in members]

    async def _sync(self, step: int) -> None:
        """At a step boundary: replicas not yet known to be at `step` copy a synced replica of
        their stage (parameters, optimizer state, step) and become members."""
        self.replicas()  # notices peers that moved stage: they join their new stage below
        members = self.members()
        current = {r.peer for stage in members for r in stage}
        self._synced &= current  # those that left are forgotten
        for stage, replicas in enumerate(members):
            sources = [r for r in replicas if r.peer in self._synced]
            for r in replicas:
                if r.peer in self._synced:
                    continue
                if not sources:
                    log.warning(
                        "stage %d: no replica at step %d to copy to %s", stage, step, r.peer
                    )
                    continue
                retry_at, delay = self._join_backoff.get(r.peer, (0.0, 0.0))
                if time.monotonic() < retry_at:
                    continue
                try:
                    joined = await self.client(stage, r).join(sources[0].address)
                except grpc.aio.AioRpcError as e:
                    if e.code() in _GONE:  # the joiner itself is absent: try it less often
                        delay = min(30.0, max(0.5, 2 * delay))
                        self._join_backoff[r.peer] = (time.monotonic() + delay, delay)
                    log.log(
                        logging.WARNING if delay <= 0.5 else logging.INFO,
                        "stage %d: %s could not join: %s",
                        stage,
                        r.peer,
                        e.details(),
                    )
                    continue
                self._join_backoff.pop(r.peer, None)
                if joined == step:
                    log.info("stage %d: %s joined at step %d", stage, r.peer, step)
                    self._synced.add(r.peer)

    async def _reconcile(self) -> int:
        """Bring every replica to the newest step. A coordinator that died while applying a step
        leaves some replicas a step behind with the step prepared: applying it is exact. Other
        laggards (new replicas, restarted ones) copy a replica of their stage at that step."""
        members = self.members()
        infos: list[tuple[int, Replica, pb.StageInfoResponse]] = []
        for stage, replicas in enumerate(members):
            for r in replicas:
                info = await self.client(stage, r).info()
                if info.job != self.job_id or info.stage != stage:
                    raise SwarmError(
                        f"{r.address} serves job {info.job!r} stage {info.stage}; "
                        f"expected job {self.job_id!r} stage {stage} "
                        f"(same job file on both sides?)"
                    )
                infos.append((stage, r, info))
        target = max((info.step for _, _, info in infos), default=0)
        for stage, r, info in infos:
            if info.step == target - 1:
                try:
                    await self.client(stage, r).commit(
                        info.step, [], 0, phase=pb.COMMIT_PHASE_APPLY
                    )
                    log.warning(
                        "finished applying step %d on %s (stage %d)", info.step, r.peer, stage
                    )
                    info.step = target
                except grpc.aio.AioRpcError as e:
                    log.warning("%s (stage %d) is a step behind: %s", r.peer, stage, e.details())
        self._synced = {r.peer for _, r, info in infos if info.step == target}
        await self._sync(target)
        missing = [k for k, replicas in enumerate(self.replicas()) if not replicas]
        if missing and all(members):
            # Every stage has members but some none with the trained state (a stage was lost
            # while no coordinator ran): every stage goes back to the last checkpoint.
            log.warning("no replica of stages %s is at step %d: rolling back", missing, target)
            await self._roll_back()
            if self.error is not None:
                raise self.error
            if self.ledger is not None and all(self.replicas()):
                return self.ledger.step
        if missing:
            raise SwarmError(f"no replica of stages {missing} is at step {target}")
        return target
