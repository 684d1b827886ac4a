"""The scheduler's orchestration: feeds the peer registry from MQTT, runs each job's placement,
rebalancing and embedded trainer, and keeps the job lifecycle in the `JobStore`.

One asyncio task per unfinished job walks it through placing → running → succeeded. Training
survives a lost stage server by going back to placing and resuming from the servers' step; a
restarted scheduler resumes its jobs the same way (receipts are idempotent, so a half-done step is
simply run again, and a half-applied commit is finished by `LocalCoordinator.start`).

One job's training (one attempt's coordinator, embedded trainer and helpers, and the final save)
is `scheduler.job_training`'s; sweeping an ended job's retained topics is `scheduler.retained`'s;
deleting the finished jobs beyond `--keep-finished-jobs` is `scheduler.retention`'s; the gauges
computed at scrape time are `scheduler.collector`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry, Counter

from scheduler.assignments import Assignments
from scheduler.collector import collector
from scheduler.coordinator import LocalCoordinator, gather_model
from scheduler.coordinator.metrics import CoordinatorFamilies
from scheduler.dial_back import StageDialer
from scheduler.ended_announcements import EndedAnnouncements
from scheduler.history import History
from scheduler.job_training import JobTraining, final_path, routes_path
from scheduler.logged import logged
from scheduler.options import SchedulerOptions
from scheduler.peer_room import PeerRoom
from scheduler.reachability import Dialer, ReachabilityChecker, retained_on
from scheduler.registry import PeerRegistry
from scheduler.replica_status import replica_status, unreachable_warnings
from scheduler.retained import clear_retained
from scheduler.retained import retained_on as retained_topics
from scheduler.retention import Retention
from scheduler.speed import RecentSpeed
from scheduler.stalls import Health
from scheduler.status_writes import StatusWrites
from scheduler.store import JobRecord, JobState, JobStore
from swarm.bus.connection import Bus, BusLike
from swarm.bus.topics import TopicError
from swarm.clock import MonotonicClock
from swarm.errors import FailedPrecondition, NotFound, SwarmError
from swarm.job.config import JobConfig, parse_job
from swarm.job.states import job_state_proto
from swarm.model import checkpoint
from swarm.model.transformer import layer_costs, partition
from swarm.net.commit_auth import KEY_FILE, SchedulerKey
from swarm.net.peer_names import BarredIds
from swarm.proto import control_pb2 as cpb
from swarm.proto import scheduler_pb2 as spb
from swarm.rpc.lease import Lease, MicrobatchResult, Working

# `collector` (scheduler.collector), `SchedulerOptions` (scheduler.options): for the entry point
__all__ = ["Scheduler", "SchedulerOptions", "collector"]

log = logging.getLogger(__name__)


class Scheduler:
    """Implements `scheduler.job_control.JobControl` for the job API."""

    def __init__(
        self,
        store: JobStore,
        bus: BusLike,
        opts: SchedulerOptions,
        registry: CollectorRegistry | None = None,
        dialer: Dialer | None = None,
    ) -> None:
        self.store, self.bus, self.opts = store, bus, opts
        self.registry = registry or CollectorRegistry()
        self.peer_registry = PeerRegistry(
            MonotonicClock(),
            load_silence_s=opts.load_silence_s,
            serve_timeout_s=opts.serve_timeout_s,
            require_reachable=True,
            # peers' silences not judged while its own link is down (a fake bus: always up)
            link=lambda: bool(getattr(bus, "connected", True)),
        )
        self.peer_room = PeerRoom(self.peer_registry)  # at most MAX_PEERS of them kept
        # Each unfinished job's waiting and warnings (placement's and the running job's watch).
        self._health: dict[str, Health] = {}
        self.history = History(store, vouched=lambda job, peer: self._training.vouched(job, peer))
        self._status = StatusWrites(store, self.history, self._announce)
        # Signs the commit protocol's calls; its public half goes out with each job's announcement.
        self.signing = SchedulerKey.load_or_create(opts.checkpoint_dir / KEY_FILE)
        self.assignments = Assignments(
            self.peer_registry,
            bus,
            self._placement_said,
            grace_s=opts.placement_grace_s,
            serve_timeout_s=opts.serve_timeout_s,
            lost_stage_grace_s=opts.lost_stage_grace_s,
            health=self.health_of,
            min_replicas=opts.min_replicas,
            banned=lambda job_id: BarredIds(
                opts.bans_bind_credentials, (ban.peer for ban in store.bans(job_id))
            ),
        )
        self.reachability = ReachabilityChecker(
            dialer or StageDialer(opts.token), retained_on(bus), self.assignments.reached
        )
        self.reachability.scope.allow_private = opts.dial_private  # --dial-private
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # Both filled by `self._training`: each job's recent speed, its open coordinator.
        self._speed: dict[str, RecentSpeed] = {}
        self._coordinators: dict[str, LocalCoordinator] = {}
        self._coordinator_metrics = CoordinatorFamilies(self.registry)
        self._moves = Counter(
            "swarm_scheduler_rebalancing_moves_total",
            "Peers moved between stages by rebalancing",
            ["job"],
            registry=self.registry,
        )
        self._training = self._job_training(opts)
        self._group: asyncio.TaskGroup | None = None
        self._user_cancelled: set[str] = set()
        self._expiring: dict[str, asyncio.Task[None]] = {}  # ended jobs, until cleared
        self._announcements = EndedAnnouncements()  # the ended jobs' that stay retained
        # Each started job's layers per stage, partitioned once off the event loop: GetJob and
        # ListJobs ask for them on it, again and again.
        self._layers: dict[str, list[range]] = {}
        self._retention = Retention(
            store, opts.keep_finished_jobs, shutting_down=self._shutting_down, delete=self.delete
        )
        # The latest record of each job, refreshed on the event loop whenever a job is announced:
        # the metrics thread reads this, never the store (its connection belongs to this thread).
        self.snapshot: dict[str, JobRecord] = {}

    def _job_training(self, opts: SchedulerOptions) -> JobTraining:
        """What training each job needs of this scheduler (`scheduler.job_training`)."""
        return JobTraining(
            self.store,
            self.bus,
            self.peer_registry,
            self.assignments,
            checkpoint_dir=opts.checkpoint_dir,
            token=opts.token,
            signing=self.signing,
            embedded_trainer=opts.embedded_trainer,
            checkpoint_every_s=opts.checkpoint_every_s,
            bans_bind_credentials=opts.bans_bind_credentials,
            announce=self._announce,
            set_status=self._set,
            coordinator_metrics=self._coordinator_metrics,
            moves=self._moves,
            coordinators=self._coordinators,
            speed=self._speed,
            history=self.history,
            health=self.health_of,
        )

    # -- lifecycle ------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        async with asyncio.TaskGroup() as group:
            self._group = group
            watcher = group.create_task(self._watch_peers())
            load = group.create_task(self._watch_load())
            dial_back = group.create_task(self.reachability.run())
            self.snapshot = {r.id: r for r in self.store.page(100)[0]}
            # the ended jobs whose announcements stay, said again: a broker that restarted
            # with this scheduler (the embedded one) holds none, and one that missed the end
            # still holds the job as running, spec and all
            kept = self.store.ended_last(self._announcements.kept)
            self._announcements.seed(kept)
            for job_id in kept:
                group.create_task(self._announce(job_id, shown=False))
            for record in self.store.unfinished():
                log.info("resuming job %s (%s, step %d)", record.id, record.state, record.step)
                self._start(record.id)
            for record in list(self.snapshot.values()):
                if record.finished:  # perhaps not cleared before a restart
                    self._expire(record.id)
            group.create_task(self._sweep_leftovers())
            group.create_task(self._retention.sweep())
            await stop.wait()
            self._group = None  # jobs submitted from now on wait in the store for the next run
            for task in [watcher, load, dial_back, *self._tasks.values(), *self._expiring.values()]:
                task.cancel()
            self._status.close()  # its held writes' retries: a restart reads the store

    def _start(self, job_id: str) -> None:
        if self._group is None:
            return  # not running (yet, or any more): `run` resumes unfinished jobs from the store
        task = self._group.create_task(self._run_job(job_id))
        self._tasks[job_id] = task  # until it has ended, its `finally` and writes too
        task.add_done_callback(
            lambda t: self._tasks.pop(job_id) if self._tasks.get(job_id) is t else None
        )

    # -- JobControl -----------------------------------------------------------------------------
    def submitted(self, job_id: str) -> None:
        self._start(job_id)

    def cancelled(self, job_id: str) -> None:
        task = self._tasks.get(job_id)  # kept until it has ended: `delete` waits for that
        record = self.store.get(job_id)
        self.history.record(
            job_id, "state", f"cancelled at step {record.step if record else 0} (swarm cancel)"
        )
        if task and not task.done():
            self._user_cancelled.add(job_id)
            task.cancel()

    def stages(self, job_id: str) -> list[spb.StageStatus]:
        ranges = self._layers.get(job_id)
        if ranges is None:
            return []  # not started yet: its run partitions it first, off the event loop
        result = [spb.StageStatus(stage=k, layers=list(r)) for k, r in enumerate(ranges)]
        coordinator = self._coordinators.get(job_id)
        membership = coordinator.membership if coordinator is not None else None
        waits = membership.waits() if membership is not None else {}
        if coordinator is not None:  # serving, and no member: nothing it does counts
            for banned in coordinator.barred(list(range(len(result)))).values():
                waits.update(dict.fromkeys(banned, "banned from this job (its history says why)"))
        standbys = membership.standbys.peers() if membership is not None else set()  # STANDBY
        admitted = self.admitted(job_id)
        for shown in self.peer_registry.shown(job_id, admitted, waits, len(result), standbys):
            result[shown.stage].replicas.append(replica_status(shown, self.peer_registry))
        return result

    def admitted(self, job_id: str) -> frozenset[str] | None:
        """The job's replicas that count: those its coordinator admitted (None: it has none
        open). Safe on the metrics thread."""
        coordinator = self._coordinators.get(job_id)
        return frozenset(coordinator.membership.synced) if coordinator is not None else None

    def standbys(self, job_id: str) -> frozenset[str]:
        """The job's standbys now (none without a coordinator). Safe on the metrics thread."""
        coordinator = self._coordinators.get(job_id)
        return frozenset(coordinator.membership.standbys.peers()) if coordinator else frozenset()

    def samples_per_second(self, job_id: str) -> float:
        speed = self._speed.get(job_id)
        return speed.rate() if speed is not None else 0.0

    def health_of(self, job_id: str) -> Health:
        """The job's waiting and warnings (kept while it is unfinished)."""
        return self._health.setdefault(job_id, Health())

    def health(self, job_id: str) -> tuple[float, list[str]]:
        health, far = self._health.get(job_id), unreachable_warnings(self.peer_registry, job_id)
        held = self._status.warning(job_id)  # a write of the job its store refused
        far = far if held is None else [held, *far]
        far = [*self._link_down(), *far]
        return (health.waiting_since, [*health.warnings, *far]) if health else (0.0, far)

    def _link_down(self) -> list[str]:
        """The scheduler's own link to its broker, while it is down: peers hear none of its
        jobs' announcements or assignments meanwhile, and a waiting job's message alone asked
        for more stage servers (a review found it)."""
        bus = self.bus
        if not isinstance(bus, Bus) or bus.connected:
            return []
        return [
            "the scheduler's link to its broker is down (its log says why, and each reconnect): "
            "peers hear nothing of this job until it is back"
        ]

    def rounds(self, job_id: str, step: int) -> spb.RoundStatus | None:
        coordinator = self._coordinators.get(job_id)
        return coordinator.rounds.status(step) if coordinator is not None else None

    async def delete(self, job_id: str) -> None:
        record = self.store.get(job_id)
        if record is not None and not record.finished:
            raise FailedPrecondition(f"job {job_id!r} is {record.state}; cancel it first")
        if self._shutting_down(job_id):  # cancelled, still shutting down
            await asyncio.wait([self._tasks[job_id]], timeout=self.opts.shutdown_wait_s)
            if self._shutting_down(job_id):
                raise FailedPrecondition(
                    f"job {job_id!r} is {record.state if record else 'ended'} but still shutting "
                    "down (writing its last checkpoint or final model); try again in a moment"
                )
        self._layers.pop(job_id, None)
        # Off the event loop: a job's checkpoints may be many large files.
        await asyncio.to_thread(_remove, self.opts.checkpoint_dir / job_id)

    def _shutting_down(self, job_id: str) -> bool:
        """Whether `job_id`'s task has not ended yet (a cancelled one may still be writing)."""
        task = self._tasks.get(job_id)
        return task is not None and not task.done()

    def routes(self, job_id: str) -> Path:
        return routes_path(self.opts.checkpoint_dir, job_id)

    async def export(self, job_id: str) -> tuple[int, dict[str, torch.Tensor]]:
        final = final_path(self.opts.checkpoint_dir, job_id)
        if final.exists():
            return await _load_final(final)
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
        try:
            return await gather_model(coordinator)
        except SwarmError:
            # The job's end overtook the download: its final model is saved before its
            # coordinator is closed and its stage servers let go, so it is there to answer with.
            if final.exists():
                return await _load_final(final)
            raise

    # -- peers ----------------------------------------------------------------------------------
    async def _watch_peers(self) -> None:
        async for _topic, message in self.bus.subscribe(self.bus.topics.peer("+")):
            if isinstance(message, cpb.PeerAnnouncement):
                # One message's unforeseen failure is said, and the next is read: this task
                # ending would end the scheduler.
                with logged(log, f"the announcement of peer {message.peer!r} was not taken"):
                    self._announced(message)

    def _announced(self, message: cpb.PeerAnnouncement) -> None:
        gone = self.peer_room.admit(message)  # at most MAX_PEERS kept: room made, or none
        if gone is None:
            return
        for peer in gone:  # as if each had announced itself offline
            self._announced(cpb.PeerAnnouncement(peer=peer, state=cpb.PEER_STATE_OFFLINE))
        old = self.peer_registry.peers.get(message.peer)
        self.peer_registry.announce(message)
        self.reachability.announced(message)  # dialled back off this loop's path
        self.history.peer(old, message)
        self.assignments.changed.set()
        if message.state == cpb.PEER_STATE_OFFLINE and old is not None:
            again = self.peer_room.waiting()  # a place freed: a peer turned away takes it
            if again is not None:
                self._announced(again)

    async def _watch_load(self) -> None:
        async for _topic, message in self.bus.subscribe(self.bus.topics.load("+")):
            if isinstance(message, cpb.LoadReport):
                with logged(log, f"the load report of peer {message.peer!r} was not taken"):
                    self.peer_registry.report_load(message)

    # -- one job --------------------------------------------------------------------------------
    def _config(self, spec: str, base_dir: str, name: str, check_data: bool = True) -> JobConfig:
        return parse_job(spec, Path(base_dir), name=name, check_data=check_data)

    def _partitioned(self, record: JobRecord) -> list[range]:
        job = self._config(record.spec, record.base_dir, record.name, check_data=False)
        return partition(layer_costs(job.model), job.training.stages)

    async def _announce(self, job_id: str, shown: bool = True) -> None:
        """Publish the job's stored record, retained; `shown`: and take it into `snapshot`
        (what the metrics and listings show: not an old ended job's, said again at a start)."""
        r = self.store.get(job_id)
        if r is None:
            return
        if shown:
            self.snapshot[job_id] = r
        message = cpb.JobAnnouncement(
            job=r.id,
            name=r.name,
            state=job_state_proto(r.state),
            step=r.step,
            steps=r.steps,
            loss=r.loss,
            # None once ended (peers only drop it): 1 MiB each, retained, piled up by submit+cancel
            spec="" if r.finished else r.spec,
            error=r.error or "",
            time=time.time(),
            scheduler_key=self.signing.public,
        )
        await self.bus.publish(self.bus.topics.job(job_id), message, retain=True)

    async def _set(self, job_id: str, state: JobState | None = None, message: str = "") -> None:
        """Store the job's state and message and announce them; one the store refuses (a full
        disk) is held and written once there is room (`scheduler.status_writes`)."""
        await self._status.set(job_id, state, message)

    async def _placement_said(self, job_id: str, message: str) -> None:
        """What placement says: the job's message while it is placed; once it runs (or stalls:
        the stall's message says what it waits for), an event (a spare placed): the message
        would outlast its cause (the spare shows as joining,
        with what it waits for, until it counts)."""
        record = self.store.get(job_id)
        if record is not None and record.state in ("running", "stalled"):
            self.history.record(job_id, "place", message)
        else:
            await self._set(job_id, None, message)

    async def lease(
        self,
        job_id: str,
        trainer: str,
        count: int,
        *,
        wait_s: float = 0.0,
        working: Sequence[Working] = (),
    ) -> Lease:
        coordinator = self._coordinators.get(job_id)
        if coordinator is None:
            record = self.store.get(job_id)
            if record is None:  # deleted since the job API first saw it
                raise NotFound(f"unknown job {job_id!r}; `swarm jobs` lists them")
            if record.state == "succeeded":
                return Lease(record.step, [], [], done=True)
            if record.finished:
                raise FailedPrecondition(f"job {job_id} is {record.state}: nothing to train")
            return Lease(0, [], [])  # not started (or between attempts): ask again soon
        return await coordinator.lease(trainer, count, wait_s=wait_s, working=working)

    async def report(
        self,
        job_id: str,
        trainer: str,
        results: list[MicrobatchResult],
        released: list[int],
        failure: str | None = None,
    ) -> None:
        coordinator = self._coordinators.get(job_id)
        if coordinator is None:
            return  # the step these belong to is gone; the ledger ignores stale reports anyway
        if released:
            await coordinator.release(trainer, released, failure)
        for result in results:
            await coordinator.report(trainer, result)

    async def _run_job(self, job_id: str) -> None:
        record = self.store.get(job_id)
        assert record is not None
        assigned: list[str] = []
        ended = True  # False only when the scheduler itself stops: the job resumes on restart
        try:
            # Off the event loop, as is all that follows from the spec: its layers per stage
            # (what GetJob shows), then the data file's hash, checked against the sha256 pinned
            # at submit (a file changed since fails the job, naming both hashes). A stored job
            # over the bounds of this version fails here, naming the bound.
            self._layers[job_id] = await asyncio.to_thread(self._partitioned, record)
            job = await asyncio.to_thread(self._config, record.spec, record.base_dir, record.name)
            if record.state == "queued":
                await self._set(job_id, "placing", "waiting for peers")
            else:
                await self._announce(job_id)
            failures = 0
            while True:
                await self.assignments.place(
                    job_id,
                    job.training.stages,
                    lambda: self.store.get(job_id).step,  # type: ignore[union-attr]
                    assigned,
                    self.assignments.floor(job),
                )
                before = self.store.get(job_id).step  # type: ignore[union-attr]
                try:
                    await self._training.run(job_id, job, assigned)
                    break
                except (SwarmError, OSError) as e:
                    step = self.store.get(job_id).step  # type: ignore[union-attr]
                    failures = 0 if step > before else failures + 1
                    if failures >= self.opts.max_failed_attempts:
                        raise
                    log.warning("job %s: training interrupted (%s); resuming", job_id, e)
                    await self._set(job_id, "placing", f"training interrupted: {e}; resuming")
                    await asyncio.sleep(self.opts.retry_pause_s)
            await self._status.written(job_id, "succeeded", "done")  # a restart must not redo it
        except asyncio.CancelledError:
            ended = job_id in self._user_cancelled  # the job API has stored "cancelled" then
            await self._announce(job_id)
            raise
        except Exception as e:
            log.exception("job %s failed", job_id)
            # One job's end must not take the scheduler (and every other job) down with it.
            with logged(log, f"job {job_id}: could not record its failure"):
                record = self.store.get(job_id)
                if record is not None and not record.finished:
                    self.history.record(job_id, "state", f"failed at step {record.step}: {e}")
                    await self._status.written(  # its event is the line above
                        job_id, "failed", "failed", error=str(e), event=False
                    )
                else:
                    await self._announce(job_id)
        finally:  # this task stays in `_tasks` until it has ended (`_start`)
            self._coordinators.pop(job_id, None)
            if ended:  # withdraw the assignments; the job's announcement frees the peers
                holders = {p.peer for p in self.peer_registry.peers.values() if p.job == job_id}
                with logged(log, f"job {job_id}: assignments not withdrawn"):
                    await self.assignments.withdraw(job_id, holders | set(assigned))
                self._ended(job_id)

    # -- an ended job ---------------------------------------------------------------------------
    def _ended(self, job_id: str) -> None:
        """Let go of what the scheduler kept for `job_id`, now ended: per-job state at once; its
        retained topics and metric series after `finished_retain_s` (`_expire`). Days of jobs grow
        nothing here."""
        self._user_cancelled.discard(job_id)
        self._speed.pop(job_id, None)
        self._health.pop(job_id, None)
        self._status.forget(job_id)
        self.history.forget(job_id)
        self._layers.pop(job_id, None)
        self._training.forget(job_id)
        self._expire(job_id)
        for old in self._announcements.ended(job_id):
            self._clear_announcement(old)
        if self._group is not None and self._retention.keep is not None:
            self._group.create_task(self._retention.sweep())

    def _expire(self, job_id: str) -> None:
        if self._group is not None and job_id not in self._expiring:
            sweep = clear_retained(self.bus, job_id, self.opts.finished_retain_s, self._forget)
            task = self._group.create_task(sweep)
            self._expiring[job_id] = task
            task.add_done_callback(lambda _: self._expiring.pop(job_id, None))

    async def _sweep_leftovers(self) -> None:
        """The retained topics of every ended (or deleted) job the broker still holds, however
        old: a sweep a stop cut short is done now. Only the newest page of jobs was looked at;
        one older kept its announcement and assignments on the broker for good. What the broker
        holds bounds the work, not the jobs ever run."""
        topics = self.bus.topics
        try:
            held = await retained_topics(self.bus, topics.job("+") + "/#")
        except Exception:
            log.exception("the retained topics of ended jobs were not looked for")
            return
        jobs: set[str] = set()
        for topic in held:
            with contextlib.suppress(TopicError):  # not one of ours: nothing to clear
                jobs.add(topics.parse(topic).job or "")
        for job_id in sorted(jobs - {""}):
            record = self.store.get(job_id)
            if record is None or record.finished:
                self._expire(job_id)
                if job_id not in self._announcements:
                    self._clear_announcement(job_id)

    def _clear_announcement(self, job_id: str) -> None:
        """Clear an ended job's retained announcement: newer ended jobs' took its place."""

        async def clear() -> None:
            record = self.store.get(job_id)
            if record is not None and not record.finished:
                return  # its id taken again by a job since (deleted, then made anew): it runs
            try:
                await self.bus.publish(self.bus.topics.job(job_id), b"", retain=True)
            except Exception:
                log.exception("job %s: retained announcement not cleared", job_id)

        if self._group is not None:
            self._group.create_task(clear())

    def _forget(self, job_id: str) -> None:
        """Let go of an ended job's last traces here (its snapshot record and metric series) once
        its retained topics are cleared: not at once, as a scrape must see a job's final counts."""
        self.snapshot.pop(job_id, None)
        self._coordinator_metrics.remove(job_id)
        self._moves.remove(job_id)


def _remove(directory: Path) -> None:
    """Remove `directory` and all it holds, if it exists (a job without a checkpoint has none)."""
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(directory)


async def _load_final(final: Path) -> tuple[int, dict[str, torch.Tensor]]:
    """A finished job's saved model, and its step (off the event loop: it may be large)."""
    saved = await asyncio.to_thread(torch.load, final, weights_only=True)
    return int(saved["step"]), saved["state"]
