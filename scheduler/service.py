"""The scheduler's orchestration: the peer registry (from MQTT), placement of peers on a job's
stages, the embedded trainer, and the job lifecycle kept in the `JobStore`.

One asyncio task per unfinished job walks it through placing → running → succeeded. Training
survives a lost stage server by going back to placing and resuming from the servers' step; a
restarted scheduler resumes its jobs the same way (receipts are idempotent, so a half-done step is
simply run again, and a half-applied commit is finished by `PipelineTrainer.check_servers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.registry import Collector

from client.trainer import PipelineTrainer, follow_load
from scheduler.coordinator import LocalCoordinator, gather_model, gather_state
from scheduler.placement import best_stage, place
from scheduler.rebalance import RebalanceConfig, plan_move
from scheduler.store import JobRecord, JobState, JobStore
from swarm import checkpoint
from swarm.bus import BusLike
from swarm.config import JobConfig, parse_job
from swarm.errors import FailedPrecondition, SwarmError
from swarm.lease import Lease, MicrobatchResult, Replica
from swarm.metrics import CoordinatorFamilies, CoordinatorMetrics, TrainerMetrics
from swarm.model import layer_costs, partition
from swarm.progress import StepRecord
from swarm.proto import control_pb2 as cpb
from swarm.proto import scheduler_pb2 as spb

__all__ = ["Scheduler", "SchedulerOptions"]

log = logging.getLogger(__name__)

_JOB_STATES = {
    "queued": cpb.JOB_STATE_QUEUED,
    "placing": cpb.JOB_STATE_PLACING,
    "running": cpb.JOB_STATE_RUNNING,
    "succeeded": cpb.JOB_STATE_SUCCEEDED,
    "failed": cpb.JOB_STATE_FAILED,
    "cancelled": cpb.JOB_STATE_CANCELLED,
}


@dataclass(frozen=True)
class SchedulerOptions:
    checkpoint_dir: Path
    placement_grace_s: float = 2.0  # once enough peers are measured, wait this long for more
    serve_timeout_s: float = 300.0  # assigned peers must be serving within this, else re-place
    retry_pause_s: float = 1.0  # after a failed training attempt, before the next one
    max_failed_attempts: int = 20  # consecutive attempts without progress before the job fails
    embedded_trainer: bool = True  # run a trainer inside the scheduler for each job
    load_silence_s: float = 10.0  # a serving peer whose load reports stop this long is left out
    # A trained job with a stage nobody serves (after a scheduler restart) waits this long for a
    # replica with the trained state, then gives the stage to fresh peers and rolls back.
    lost_stage_grace_s: float = 30.0
    token: str | None = None  # swarm token for calls to stage servers


class Scheduler:
    """Implements `scheduler.job_api.JobControl` for the job API."""

    def __init__(
        self,
        store: JobStore,
        bus: BusLike,
        opts: SchedulerOptions,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.store, self.bus, self.opts = store, bus, opts
        self.registry = registry or CollectorRegistry()
        self.peers: dict[str, cpb.PeerAnnouncement] = {}
        self._peers_changed = asyncio.Event()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._speed: dict[str, float] = {}
        self._unplaceable: set[str] = set()  # peers already warned about
        # peer -> (job, when) of its last assignment, until it serves or leaves: a peer building
        # its stage still says JOINING, and must not be assigned again (perhaps elsewhere).
        self._assigned_at: dict[str, tuple[str, float]] = {}
        self._coordinators: dict[str, LocalCoordinator] = {}
        self._coordinator_metrics = CoordinatorFamilies(self.registry)
        self._live: dict[tuple[str, str], tuple[int, float]] = {}  # (job, peer) -> stage, speed
        self._reported: dict[tuple[str, str], float] = {}  # (job, peer) -> last load report
        self._silent: set[tuple[str, str]] = set()
        self._moves = Counter(
            "swarm_scheduler_rebalancing_moves_total",
            "Peers moved between stages by rebalancing",
            ["job"],
            registry=self.registry,
        )
        self._group: asyncio.TaskGroup | None = None
        self._user_cancelled: set[str] = set()
        # The latest record of each job, refreshed on the event loop whenever a job is announced:
        # the metrics thread reads this, never the store (its connection belongs to this thread).
        self.snapshot: dict[str, JobRecord] = {}

    # -- lifecycle ------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        async with asyncio.TaskGroup() as group:
            self._group = group
            watcher = group.create_task(self._watch_peers())
            load = group.create_task(self._watch_load())
            self.snapshot = {r.id: r for r in self.store.list()[:100]}
            for record in self.store.unfinished():
                log.info("resuming job %s (%s, step %d)", record.id, record.state, record.step)
                self._start(record.id)
            await stop.wait()
            self._group = None  # jobs submitted from now on wait in the store for the next run
            for task in [watcher, load, *self._tasks.values()]:
                task.cancel()

    def _start(self, job_id: str) -> None:
        if self._group is None:
            return  # not running (yet, or any more): `run` resumes unfinished jobs from the store
        self._tasks[job_id] = self._group.create_task(self._run_job(job_id))

    # -- JobControl -----------------------------------------------------------------------------
    def submitted(self, job_id: str) -> None:
        self._start(job_id)

    def cancelled(self, job_id: str) -> None:
        task = self._tasks.pop(job_id, None)
        if task:
            self._user_cancelled.add(job_id)
            task.cancel()

    def stages(self, job_id: str) -> list[spb.StageStatus]:
        record = self.store.get(job_id)
        if record is None:
            return []
        job = self._config(record.spec, record.base_dir, record.name, check_data=False)
        ranges = partition(layer_costs(job.model), job.training.stages)
        result = [spb.StageStatus(stage=k, layers=list(r)) for k, r in enumerate(ranges)]
        for p in self.peers.values():
            if p.job == job_id and p.HasField("stage") and p.stage < len(result):
                result[p.stage].replicas.append(
                    spb.Replica(
                        peer=p.peer,
                        address=p.address,
                        metrics_address=p.metrics_address,
                        device=p.device,
                        state=p.state,
                        samples_per_second=p.samples_per_second.get(p.stage, 0.0),
                    )
                )
        return result

    def samples_per_second(self, job_id: str) -> float:
        return self._speed.get(job_id, 0.0)

    async def export(self, job_id: str) -> tuple[int, dict[str, torch.Tensor]]:
        final = self._final_path(job_id)
        if final.exists():
            saved = await asyncio.to_thread(torch.load, final, weights_only=True)
            return int(saved["step"]), saved["state"]
        coordinator = self._coordinators.get(job_id)
        if coordinator is None or any(not stage for stage in coordinator.replicas()):
            saved = checkpoint.latest(self.opts.checkpoint_dir / job_id)
            if saved is not None:  # no live replica of every stage: the last checkpoint
                return saved, await asyncio.to_thread(
                    checkpoint.load_model, self.opts.checkpoint_dir / job_id, saved
                )
            raise FailedPrecondition(
                f"job {job_id} has no live replica of every stage and no saved model yet"
            )
        return await gather_model(coordinator)

    # -- peers ----------------------------------------------------------------------------------
    async def _watch_load(self) -> None:
        """Live samples/s of each serving peer on its stage, from its load reports."""
        async for _topic, message in self.bus.subscribe(self.bus.topics.load("+", "+")):
            if isinstance(message, cpb.LoadReport):
                self._reported[(message.job, message.peer)] = time.monotonic()
                self._silent.discard((message.job, message.peer))
            if isinstance(message, cpb.LoadReport) and message.ema_seconds_per_sample > 0:
                self._live[(message.job, message.peer)] = (
                    message.stage,
                    1.0 / message.ema_seconds_per_sample,
                )

    async def _rebalance(self, job_id: str, job: JobConfig) -> None:
        """Every period, move one peer from an over-served stage to the bottleneck when the
        policy says it pays (`scheduler.rebalance.plan_move`). The moved peer drains; what it held
        at its old stage is replayed; it copies its new stage's state at a step boundary."""
        r = job.rebalance
        config = RebalanceConfig(
            period_s=r.period_s,
            hysteresis=r.hysteresis,
            min_dwell_s=r.min_dwell_s,
            move_cost_s=r.move_cost_s,
            horizon_s=r.horizon_s,
        )
        stages, last_moved = job.training.stages, dict[str, float]()
        while True:
            await asyncio.sleep(config.period_s)
            members = self.members(job_id, stages)
            assignment = {rep.peer: k for k, reps in enumerate(members) for rep in reps}
            if not all(
                (self._live.get((job_id, peer)) or (None,))[0] == k
                for peer, k in assignment.items()
            ):
                continue  # decide on measured throughput only: wait for every member's report
            speeds: dict[str, list[float]] = {}
            for peer, k in assignment.items():
                announced = self.peers[peer].samples_per_second  # members come from self.peers
                speeds[peer] = [announced.get(j, 0.0) for j in range(stages)]
                live = self._live.get((job_id, peer))
                if live and live[0] == k:  # what it really does where it is now
                    speeds[peer][k] = live[1]
            move = plan_move(
                assignment,
                speeds,
                stages,
                now=time.monotonic(),
                last_moved=last_moved,
                config=config,
            )
            if move is None:
                continue
            last_moved[move.peer] = time.monotonic()
            self._moves.labels(job=job_id).inc()
            log.warning(
                "job %s: rebalancing: moving %s from stage %d to stage %d (bottleneck "
                "%.1f -> %.1f samples/s)",
                job_id,
                move.peer,
                move.src,
                move.dst,
                move.before,
                move.after,
            )
            message = cpb.Assignment(
                job=job_id, peer=move.peer, stage=move.dst, generation=time.time_ns() // 1000
            )
            await self.bus.publish(self.bus.topics.assign(job_id, move.peer), message, retain=True)

    async def _watch_peers(self) -> None:
        async for _topic, message in self.bus.subscribe(self.bus.topics.peer("+")):
            if isinstance(message, cpb.PeerAnnouncement) and message.peer:
                self.peers[message.peer] = message
                if message.state != cpb.PEER_STATE_JOINING:  # serving, moving, or gone
                    self._assigned_at.pop(message.peer, None)
                self._peers_changed.set()

    async def _peers_change(self, timeout: float) -> None:
        self._peers_changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._peers_changed.wait(), timeout)

    def _serving(self, job_id: str, step: int | None = None) -> dict[int, str]:
        """Per stage, the address of the fastest replica serving it."""
        best: dict[int, tuple[float, str]] = {}
        for p in self.peers.values():
            if p.job == job_id and p.state == cpb.PEER_STATE_SERVING and p.HasField("stage"):
                speed = p.samples_per_second.get(p.stage, 0.0)
                if p.stage not in best or speed > best[p.stage][0]:
                    best[p.stage] = (speed, p.address)
        return {k: address for k, (_, address) in best.items()}

    def _available(self, job_id: str, stages: int) -> dict[str, list[float]]:
        """Joining peers measured for this job: their samples/s per stage. A peer whose figures
        cannot be placed (not finite, negative, none positive) is left out, with a log line."""
        available = {}
        now = time.monotonic()
        for p in self.peers.values():
            if not (
                p.state == cpb.PEER_STATE_JOINING
                and p.job == job_id
                and all(k in p.samples_per_second for k in range(stages))
            ):
                continue
            job, assigned_at = self._assigned_at.get(p.peer, ("", 0.0))
            if job == job_id and now - assigned_at < self.opts.serve_timeout_s:
                continue  # building the stage it was given
            speeds = [p.samples_per_second[k] for k in range(stages)]
            if all(math.isfinite(v) and v >= 0.0 for v in speeds) and max(speeds) > 0.0:
                available[p.peer] = speeds
            elif p.peer not in self._unplaceable:
                self._unplaceable.add(p.peer)
                log.warning("peer %s announced unusable speeds %s: not placed", p.peer, speeds)
        return available

    # -- one job --------------------------------------------------------------------------------
    def _config(self, spec: str, base_dir: str, name: str, check_data: bool = True) -> JobConfig:
        return parse_job(spec, Path(base_dir), name=name, check_data=check_data)

    async def _announce(self, job_id: str) -> None:
        r = self.store.get(job_id)
        if r is None:
            return
        self.snapshot[job_id] = r
        message = cpb.JobAnnouncement(
            job=r.id,
            name=r.name,
            state=_JOB_STATES[r.state],
            step=r.step,
            steps=r.steps,
            loss=r.loss,
            spec=r.spec,
            error=r.error or "",
            time=time.time(),
        )
        await self.bus.publish(self.bus.topics.job(job_id), message, retain=True)

    async def _set(self, job_id: str, state: JobState | None = None, message: str = "") -> None:
        record = self.store.get(job_id)
        if record is None:
            return
        if state and state != record.state:
            self.store.set_state(job_id, state, message=message)
        elif message != (record.message or ""):
            self.store.set_message(job_id, message)
        await self._announce(job_id)

    def members(self, job_id: str, stages: int) -> list[list[Replica]]:
        """Per stage, the peers serving it for this job, in a stable order."""
        result: list[list[Replica]] = [[] for _ in range(stages)]
        now = time.monotonic()
        for p in sorted(self.peers.values(), key=lambda p: p.peer):
            reported = self._reported.get((job_id, p.peer))
            if reported is not None and now - reported > self.opts.load_silence_s:
                if (job_id, p.peer) not in self._silent:  # hung, or cut off: not a member
                    self._silent.add((job_id, p.peer))
                    log.warning(
                        "job %s: %s's load reports stopped %.0fs ago; leaving it out",
                        job_id,
                        p.peer,
                        now - reported,
                    )
                continue
            if (
                p.job == job_id
                and p.state == cpb.PEER_STATE_SERVING
                and p.HasField("stage")
                and p.stage < stages
            ):
                result[p.stage].append(
                    Replica(p.peer, p.address, p.samples_per_second.get(p.stage, 0.0))
                )
        return result

    async def lease(self, job_id: str, trainer: str, count: int) -> Lease:
        coordinator = self._coordinators.get(job_id)
        if coordinator is None:
            record = self.store.get(job_id)
            if record is not None and record.state == "succeeded":
                return Lease(record.step, [], [], done=True)
            if record is not None and record.finished:
                raise FailedPrecondition(f"job {job_id} is {record.state}: nothing to train")
            return Lease(0, [], [])  # not started (or between attempts): ask again soon
        return await coordinator.lease(trainer, count)

    async def report(
        self, job_id: str, trainer: str, results: list[MicrobatchResult], released: list[int]
    ) -> None:
        coordinator = self._coordinators.get(job_id)
        if coordinator is None:
            return  # the step these belong to is gone; the ledger ignores stale reports anyway
        if released:
            await coordinator.release(trainer, released)
        for result in results:
            await coordinator.report(trainer, result)

    async def _run_job(self, job_id: str) -> None:
        record = self.store.get(job_id)
        assert record is not None
        assigned: list[str] = []
        ended = True  # False only when the scheduler itself stops: the job resumes on restart
        try:
            job = self._config(record.spec, record.base_dir, record.name)
            if record.state == "queued":
                await self._set(job_id, "placing", "waiting for peers")
            else:
                await self._announce(job_id)
            failures = 0
            while True:
                await self._place(job_id, job, assigned)
                before = self.store.get(job_id).step  # type: ignore[union-attr]
                try:
                    await self._train(job_id, job, assigned)
                    break
                except (SwarmError, OSError, grpc.aio.AioRpcError) as e:
                    step = self.store.get(job_id).step  # type: ignore[union-attr]
                    failures = 0 if step > before else failures + 1
                    if failures >= self.opts.max_failed_attempts:
                        raise
                    log.warning("job %s: training interrupted (%s); resuming", job_id, e)
                    await self._set(job_id, "placing", f"training interrupted: {e}; resuming")
                    await asyncio.sleep(self.opts.retry_pause_s)
            await self._set(job_id, "succeeded", "done")
        except asyncio.CancelledError:
            ended = job_id in self._user_cancelled  # the job API has stored "cancelled" then
            await self._announce(job_id)
            raise
        except Exception as e:
            log.exception("job %s failed", job_id)
            # One job's end must not take the scheduler (and every other job) down with it.
            with _logged(f"job {job_id}: could not record its failure"):
                record = self.store.get(job_id)
                if record is not None and not record.finished:
                    self.store.set_state(job_id, "failed", error=str(e), message="failed")
                await self._announce(job_id)
        finally:
            self._tasks.pop(job_id, None)
            self._coordinators.pop(job_id, None)
            if ended:  # withdraw the assignments; the job's announcement frees the peers
                holders = {p.peer for p in self.peers.values() if p.job == job_id}
                with _logged(f"job {job_id}: assignments not withdrawn"):
                    for peer in sorted(holders | set(assigned)):
                        topic = self.bus.topics.assign(job_id, peer)
                        await self.bus.publish(topic, b"", retain=True)

    async def _place(self, job_id: str, job: JobConfig, assigned: list[str]) -> None:
        """Wait until every stage has a serving replica, assigning measured peers."""
        stages = job.training.stages
        lost_since: float | None = None
        while True:
            serving = self._serving(job_id)
            missing = [k for k in range(stages) if k not in serving]
            if not missing:
                return
            record = self.store.get(job_id)
            assert record is not None
            lost_since = lost_since or time.monotonic()
            if record.step > 0 and time.monotonic() - lost_since < self.opts.lost_stage_grace_s:
                # A replica with the trained state may still come back; after the grace period
                # fresh peers take the stage and the coordinator rolls back to a checkpoint.
                await self._set(
                    job_id,
                    None,
                    f"waiting for a replica of stages {missing} "
                    f"(trained state lives on its servers)",
                )
                await self._peers_change(5.0)
                continue
            available = self._available(job_id, stages)
            if len(available) < len(missing):
                await self._set(
                    job_id,
                    None,
                    f"waiting for peers: stages {missing} have no "
                    f"replica, {len(available)} peer(s) measured",
                )
                await self._peers_change(5.0)
                continue
            await asyncio.sleep(self.opts.placement_grace_s)  # let late peers finish measuring
            available = self._available(job_id, stages)
            if len(available) < len(missing):
                continue  # some left during the grace period
            await self._assign(job_id, available, assigned)
            await self._wait_serving(job_id, missing)

    async def _assign(
        self, job_id: str, available: dict[str, list[float]], assigned: list[str]
    ) -> None:
        """Every available peer gets a stage: placement for a fresh job, the stage that raises
        the bottleneck most for peers joining a running one."""
        stages = len(next(iter(available.values())))
        serving = self.members(job_id, stages)
        if any(serving):
            totals = [sum(r.throughput for r in stage) for stage in serving]
            placement = {}
            for peer, speeds in sorted(available.items()):
                placement[peer] = best_stage(speeds, totals)
                totals[placement[peer]] += speeds[placement[peer]]
        else:
            placement = place(available, stages)
        generation = time.time_ns() // 1000  # grows across scheduler restarts
        for peer, stage in sorted(placement.items()):
            log.info(
                "job %s: stage %d -> %s (%.1f samples/s)",
                job_id,
                stage,
                peer,
                available[peer][stage],
            )
            message = cpb.Assignment(job=job_id, peer=peer, stage=stage, generation=generation)
            await self.bus.publish(self.bus.topics.assign(job_id, peer), message, retain=True)
            self._assigned_at[peer] = (job_id, time.monotonic())
            assigned.append(peer)
        await self._set(job_id, None, f"starting {len(placement)} stage server(s)")

    async def _wait_serving(self, job_id: str, stages: list[int]) -> None:
        deadline = time.monotonic() + self.opts.serve_timeout_s
        while time.monotonic() < deadline:
            if all(k in self._serving(job_id) for k in stages):
                return
            await self._peers_change(1.0)
        log.warning(
            "job %s: stages %s not serving after %.0fs; placing again",
            job_id,
            stages,
            self.opts.serve_timeout_s,
        )

    async def _grow(self, job_id: str, job: JobConfig, assigned: list[str]) -> None:
        """While the job trains, peers that join become extra replicas (they copy a live
        replica's state at the next step boundary)."""
        while True:
            await self._peers_change(5.0)
            available = self._available(job_id, job.training.stages)
            if available:
                await asyncio.sleep(self.opts.placement_grace_s)
                available = self._available(job_id, job.training.stages)
                if available:
                    await self._assign(job_id, available, assigned)

    def _trainer_metrics(self, job_id: str) -> TrainerMetrics:
        return TrainerMetrics(job_id, registry=CollectorRegistry())

    async def _train(self, job_id: str, job: JobConfig, assigned: list[str]) -> None:
        async def committed(record: StepRecord) -> None:
            self.store.record_step(job_id, record.step, record.loss, record.samples, record.seconds)
            self._speed[job_id] = record.samples_per_second
            log.info("job %s step %d loss %.4f", job_id, record.step, record.loss)
            await self.bus.publish(
                self.bus.topics.steps(job_id),
                cpb.StepCommitted(
                    job=job_id,
                    step=record.step,
                    loss=record.loss,
                    samples=record.samples,
                    time=time.time(),
                ),
                retain=True,
            )
            await self._announce(job_id)

        stages = job.training.stages

        said: list[str] = []  # what a rollback told `swarm status`, kept past the start

        async def rolled_back(step: int) -> None:
            self.store.rewind(job_id, step)
            said.append(
                f"rolled back to step {step}: a stage lost every "
                f"replica; training from the last checkpoint"
            )
            await self._set(job_id, None, said[-1])

        coordinator = LocalCoordinator(
            job,
            job_id,
            lambda: self.members(job_id, stages),
            token=self.opts.token,
            on_step=committed,
            checkpoint_dir=self.opts.checkpoint_dir / job_id,
            on_rollback=rolled_back,
            metrics=CoordinatorMetrics(job_id, families=self._coordinator_metrics),
        )
        trainer = PipelineTrainer(
            job,
            coordinator,
            job_id=job_id,
            token=self.opts.token,
            trainer_id=f"{job_id}-embedded",
            metrics=self._trainer_metrics(job_id),
        )
        try:
            await coordinator.start()
            self._coordinators[job_id] = coordinator
            await self._set(job_id, "running", said[-1] if said else "training")
            try:
                async with asyncio.TaskGroup() as group:
                    grow = group.create_task(self._grow(job_id, job, assigned))
                    rebalance = (
                        group.create_task(self._rebalance(job_id, job))
                        if (job.rebalance.enabled)
                        else None
                    )
                    load = group.create_task(
                        follow_load(self.bus, job_id, trainer.wiring, job.training.microbatch_size)
                    )
                    if self.opts.embedded_trainer:
                        group.create_task(trainer.run())
                    await coordinator.finished.wait()
                    grow.cancel()
                    load.cancel()
                    if rebalance:
                        rebalance.cancel()
            except ExceptionGroup as failed:
                # One child's error, unwrapped, so `_run_job` tells one worth retrying (a peer
                # gone, a broker hiccup) from a bug.
                raise failed.exceptions[0] from failed
            if coordinator.error:
                raise coordinator.error
            state = await gather_state(coordinator)
            self._save_final(job_id, job.training.steps, state)
        finally:
            self._coordinators.pop(job_id, None)
            await trainer.close()
            await coordinator.close()

    def _final_path(self, job_id: str) -> Path:
        return self.opts.checkpoint_dir / job_id / "final.pt"

    def _save_final(self, job_id: str, step: int, state: dict[str, torch.Tensor]) -> None:
        path = self._final_path(job_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"step": step, "state": state}, tmp)
        tmp.replace(path)  # atomic: an export never sees half a file


def collector(scheduler: Scheduler) -> Collector:
    """A Prometheus collector computing peers per stage and state, per-stage throughput, and job
    state, step and loss at scrape time from the scheduler's live state (nothing to sync)."""
    from prometheus_client.core import GaugeMetricFamily, Metric

    class _Collector(Collector):
        def collect(self) -> Iterable[Metric]:
            peers = GaugeMetricFamily(
                "swarm_scheduler_peers",
                "Peers by job, stage and state",
                labels=["job", "stage", "state"],
            )
            speed = GaugeMetricFamily(
                "swarm_scheduler_stage_samples_per_second",
                "Summed measured samples/s of a stage's serving replicas",
                labels=["job", "stage"],
            )
            counts: dict[tuple[str, str, str], int] = {}
            totals: dict[tuple[str, str], float] = {}
            for p in list(scheduler.peers.values()):
                stage = str(p.stage) if p.HasField("stage") else ""
                state = cpb.PeerState.Name(p.state).removeprefix("PEER_STATE_").lower()
                counts[(p.job, stage, state)] = counts.get((p.job, stage, state), 0) + 1
                if p.state == cpb.PEER_STATE_SERVING and stage:
                    key = (p.job, stage)
                    totals[key] = totals.get(key, 0.0) + p.samples_per_second.get(p.stage, 0.0)
            for labels, n in counts.items():
                peers.add_metric(list(labels), n)
            for labels2, value in totals.items():
                speed.add_metric(list(labels2), value)
            job_state = GaugeMetricFamily(
                "swarm_job_state", "1 for the job's current state", labels=["job", "state"]
            )
            step = GaugeMetricFamily("swarm_job_step", "Steps committed", labels=["job"])
            loss = GaugeMetricFamily(
                "swarm_job_loss", "Loss of the last committed step", labels=["job"]
            )
            for job_id, record in list(scheduler.snapshot.items()):
                for name in _JOB_STATES:
                    job_state.add_metric([job_id, name], 1.0 if name == record.state else 0.0)
                step.add_metric([job_id], record.step)
                if not math.isnan(record.loss):
                    loss.add_metric([job_id], record.loss)
            yield from (peers, speed, job_state, step, loss)

    return _Collector()


@contextlib.contextmanager
def _logged(what: str) -> Iterator[None]:
    """Log an exception (with `what` it stopped) instead of raising it."""
    try:
        yield
    except Exception:
        log.exception("%s", what)
