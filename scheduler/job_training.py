"""One job's training inside the scheduler: for each attempt, the step coordinator, the embedded
trainer and the helpers around them (growing the placement, following load reports, rebalancing),
run until the last step commits; then the trained model is saved as the job's final file.

Why an attempt: a lost stage server ends one (`Scheduler` re-places the job and starts another),
so everything built here lives exactly as long as one attempt and is closed on the way out,
whatever ended it. The coordinator is registered with the scheduler (`coordinators`) from its
start until just before its close, so leases and exports never reach a closed one. Committed
steps reach the store before they are announced: `swarm status` and a restarted scheduler read
the store. The final file is written as every checkpoint file is (fsynced, whole or not at all),
off the event loop, so an export never reads half a model; a save that fails (a full disk) ends
nothing: the job stays running with its peers holding the trained state, its status line says
so, and the save is tried again after a growing pause.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry, Counter

from client.metrics import TrainerMetrics
from client.trainer import PipelineTrainer, follow_load
from scheduler.aggregators import offered
from scheduler.assignments import Assignments
from scheduler.coordinator import LocalCoordinator, gather_state
from scheduler.coordinator.groups import Aggregator, Groups, Link, link_of
from scheduler.coordinator.metrics import CoordinatorFamilies, CoordinatorMetrics
from scheduler.coordinator.recovery import to_thread_to_the_end
from scheduler.coordinator.replicas import grpc_replicas
from scheduler.failure_domains import domains_of
from scheduler.history import History
from scheduler.job_reports import NEWS_SAID_STEPS, AttemptReports
from scheduler.rebalance_loop import Mover
from scheduler.registry import PeerRegistry
from scheduler.route_file import RouteFile, incomplete_path
from scheduler.speed import RecentSpeed
from scheduler.stalls import Health, StallWatch
from scheduler.store import JobState, JobStore, StoreError
from scheduler.stored_bans import StoredBans
from scheduler.trainer_keys import embedded_trainer
from swarm.alongside import alongside
from swarm.bus.connection import BusLike
from swarm.job.config import JobConfig
from swarm.job.rule import rule_of
from swarm.model import checkpoint
from swarm.net.commit_auth import SchedulerKey
from swarm.policy.backoff import Backoff
from swarm.policy.domains import Domains

__all__ = ["NEWS_SAID_STEPS", "JobTraining", "final_path", "save_final"]

log = logging.getLogger(__name__)


@dataclass
class JobTraining:
    """What training a job needs of the scheduler (shared by all its jobs), and `run`, one
    attempt at training one job."""

    store: JobStore
    bus: BusLike
    peer_registry: PeerRegistry
    assignments: Assignments
    checkpoint_dir: Path  # each job's checkpoints and final file go in a directory of its own
    token: str | None  # swarm token for calls to stage servers
    embedded_trainer: bool  # run a trainer inside the scheduler for each job
    checkpoint_every_s: float | None  # checkpoint at least this often (besides by steps)
    announce: Callable[[str], Awaitable[None]]  # publish the job's stored record
    set_status: Callable[[str, JobState | None, str], Awaitable[None]]  # store it, then announce
    coordinator_metrics: CoordinatorFamilies
    moves: Counter  # rebalancing moves, by job
    coordinators: dict[str, LocalCoordinator]  # the open ones, by job: leases and exports
    speed: dict[str, RecentSpeed]  # each job's samples/s over its recent steps
    history: History  # each job's events
    health: Callable[[str], Health]  # each job's waiting and warnings
    # the first and the longest pause between attempts at saving a job's final model (seconds)
    final_save_retry_s: tuple[float, float] = (1.0, 60.0)
    # signs the commit protocol's calls (`swarm.net.commit_auth`); None: they go unsigned
    signing: SchedulerKey | None = None
    # peer ids are bound to certificates (the embedded broker under --use-identity-as-username):
    # a ban bars every id of the banned peer's certificate (`scheduler.coordinator.trust.bans`)
    bans_bind_credentials: bool = False
    # each job's ban book while a write of it waits for room (a full disk): the next attempt
    # starts with what it holds (`scheduler.stored_bans`)
    ban_books: dict[str, StoredBans] = field(default_factory=dict)
    # the jobs an attempt has started for in this scheduler's run: only a first attempt waits
    # at its start for the holders of the job's trained step (`coordinator.holders`)
    _attempted: set[str] = field(default_factory=set)

    def vouched(self, job_id: str, peer: str) -> bool:
        """Whether the scheduler gave `peer` a stage of `job_id`, or the job's coordinator
        admitted it: what a peer announces counts for such a job only (`History`)."""
        if self.peer_registry.given(job_id, peer) is not None:
            return True
        coordinator = self.coordinators.get(job_id)
        return coordinator is not None and peer in coordinator.membership.synced

    async def run(self, job_id: str, job: JobConfig, assigned: list[str]) -> None:
        """Train `job_id` from the step its servers hold to the end and save the final model.
        Raises what ended the attempt early (a `SwarmError` or `OSError` is worth another)."""
        speed = self.speed.setdefault(job_id, RecentSpeed(time.time))
        reports = AttemptReports(
            job_id, self.store, self.bus, self.history, self.announce, self.set_status, speed
        )
        routes = self._open_routes(job_id, job)
        coordinator = self._coordinator(job_id, job, reports, routes)
        trainer = PipelineTrainer(
            job,
            coordinator,
            job_id=job_id,
            token=self.token,
            trainer_id=embedded_trainer(job_id),
            metrics=_trainer_metrics(job_id),
        )
        try:
            # A first attempt (this scheduler just started: peers come back one by one) waits
            # for the holders of the step the job has trained as placement waits for a lost
            # stage's. A later one follows placement, which waited for them already.
            wait_s = 0.0 if job_id in self._attempted else self.assignments.lost_stage_grace_s
            self._attempted.add(job_id)
            started = await coordinator.start(self.store.trained(job_id), wait_s)
            self.store.resume(job_id, started)  # a re-run replaces old rows
            self.coordinators[job_id] = coordinator
            speed.start()
            await self.set_status(job_id, "running", reports.opening)
            await self._train(job_id, job, assigned, coordinator, trainer, reports)
            if coordinator.error:
                raise coordinator.error
            state = await gather_state(coordinator)
            await self._save_final(job_id, job.training.steps, state)
        finally:
            self.coordinators.pop(job_id, None)
            book = self.ban_books.get(job_id)
            if book is not None and not book.waiting:
                del self.ban_books[job_id]
            try:  # each closed whatever the one before did, a cancellation included
                await trainer.close()
            finally:
                try:
                    await coordinator.close()
                finally:
                    if routes is not None:
                        routes.close()

    def forget(self, job_id: str) -> None:
        """Let go of what was kept for `job_id` across its attempts, now that it has ended."""
        self._attempted.discard(job_id)

    def _ban_book(self, job_id: str) -> StoredBans:
        """The job's ban book: the one before while a write of it waits (a full disk), else a
        new one. Kept only while one waits: nothing grows with the jobs a scheduler ran."""
        book = self.ban_books.pop(job_id, None)
        if book is None or not book.waiting:
            book = StoredBans(self.store, job_id, self.bans_bind_credentials)
        self.ban_books[job_id] = book
        return book

    def _open_routes(self, job_id: str, job: JobConfig) -> RouteFile | None:
        """The job's route record, opened to append (a resumed job's record goes on), where its
        rule records routes and no write ended it before; the caller closes it."""
        if not rule_of(job).records_routes:
            return None
        path = routes_path(self.checkpoint_dir, job_id)
        if incomplete_path(path).exists():
            return None  # ended by a failed write (`RouteFile`): a gap would replay wrongly
        return RouteFile(path, job_id)  # closed by `run`

    def _coordinator(
        self, job_id: str, job: JobConfig, reports: AttemptReports, routes: RouteFile | None
    ) -> LocalCoordinator:
        """The attempt's step coordinator: its members from the registry, its callbacks to
        `reports`, its bans kept in the store across restarts."""
        stages = job.training.stages
        coordinator = LocalCoordinator(
            job,
            job_id,
            lambda: self.peer_registry.members(job_id, stages),
            token=self.token,
            connect=grpc_replicas(job, job_id, self.token, self.signing),
            on_step=reports.committed,
            checkpoint_dir=self.checkpoint_dir / job_id,
            # a rollback says why no standby took a lost stage (`Standbys.missed`, read then)
            on_rollback=lambda step: reports.rolled_back(
                step, coordinator.membership.standbys.missed
            ),
            on_status=reports.status,
            on_ban=reports.banned,
            bans=self._ban_book(job_id),  # kept across attempts and restarts
            metrics=CoordinatorMetrics(job_id, families=self.coordinator_metrics),
            on_route=routes,
            checkpoint_every_s=self.checkpoint_every_s,
            # parts by the links the peers announced (issue 43)
            groups=Groups(
                lambda peer: link_of(self.peer_registry.peers.get(peer)),
                offered(
                    self.peer_registry.peers, lambda a: Aggregator(a.peer, a.address, Link(a.rate))
                ),
            ),
        )
        coordinator.membership.admitted.append(functools.partial(self.history.admitted, job_id))
        # a stage whose holder's Discard got no answer: why it neither resumes nor rolls back yet
        coordinator.membership.discards.said.append(
            lambda stage, peer, text: self.history.record(job_id, "readmit", text)
        )
        self._stand_by(job_id, job, coordinator)
        return coordinator

    async def _train(
        self,
        job_id: str,
        job: JobConfig,
        assigned: list[str],
        coordinator: LocalCoordinator,
        trainer: PipelineTrainer,
        reports: AttemptReports,
    ) -> None:
        """Run the embedded trainer and the helpers around the coordinator (growing the
        placement, following load reports, watching for stalls, rebalancing) until the
        coordinator says the job is finished; then the helpers stop."""
        stages = job.training.stages
        floor = self.assignments.floor(job)
        mover = Mover(
            job_id,
            stages,
            job.rebalance,
            self.assignments,
            self.moves,
            floor,
            coordinator.set_aside,  # its standbys and its banned peers: no replicas to move
            lambda: coordinator.membership.standbys.short,
        )
        watch = self._stall_watch(job_id, job, coordinator, trainer, reports, mover, floor)
        helpers = [  # stopped when the job ends; the first error ends it (`swarm.alongside`)
            self.assignments.grow(job_id, stages, assigned, floor),
            follow_load(self.bus, job_id, trainer.wiring, job.training.microbatch_size),
            watch.run(),
        ]
        if job.rebalance.enabled:
            helpers.append(mover.run())
        # The embedded trainer runs to its own end. An error, unwrapped, tells the scheduler one
        # worth retrying (a peer gone, a broker hiccup) from a bug; a cancellation beats it.
        trainers = [trainer.run()] if self.embedded_trainer else []
        await alongside(coordinator.finished.wait(), helpers, to_the_end=trainers)

    def _stall_watch(
        self,
        job_id: str,
        job: JobConfig,
        coordinator: LocalCoordinator,
        trainer: PipelineTrainer,
        reports: AttemptReports,
        mover: Mover,
        floor: int,
    ) -> StallWatch:
        """What watches the job for what it waits on: stages without replicas, steps that
        stopped (naming the embedded trainer's last failure, issue 63)."""
        return StallWatch(
            job_id,
            coordinator.members,  # the registry's, less the peers banned from the job
            lambda: self._step(job_id),
            coordinator.recovery.latest,
            lambda text, state: self.set_status(job_id, state, text),
            reports.message,
            self.history,
            self.health(job_id),
            speed=reports.speed,
            progress=coordinator.progress,
            refill=mover.refill,
            min_replicas=floor,
            counted=coordinator.replicas,
            lost=lambda missing: self.peer_registry.lost_relays(job_id, missing),
            barred=coordinator.barred,
            refused=lambda: mover.refused,
            domains=self.peer_registry.domains,
            # that no trainer asks for work at all (first: a gone trainer's failure is not why),
            # else the embedded trainer's failure, or one a remote trainer gave work back with
            cause=lambda: (
                self._no_trainer(job_id, coordinator)
                or trainer.failure
                or coordinator.trainers_failure
            ),
            patience_s=job.runtime.patience_s,
        )

    def _no_trainer(self, job_id: str, coordinator: LocalCoordinator) -> str | None:
        """That no trainer has asked `job_id` for work for longer than a lease lasts, and what to
        do (under `--no-embedded-trainer` a job waits for a remote one: the stall watch said
        nothing of it, or blamed a replica); None while one asks."""
        since = coordinator.trainers_silent_since()
        if since is None:
            return None
        at = time.strftime("%H:%M:%S", time.localtime(since))
        if self.embedded_trainer:
            return f"no trainer has asked for work since {at}, the scheduler's own included"
        return (
            f"no trainer has asked for work since {at}: this scheduler runs none of its own "
            f"(--no-embedded-trainer); start one: swarm trainer --scheduler HOST:PORT --job "
            f"{job_id}"
        )

    def _stand_by(self, job_id: str, job: JobConfig, coordinator: LocalCoordinator) -> None:
        """The job's standbys (`scheduler.coordinator.standbys`), each on a host none of its
        stage's replicas is on: `runtime.standby = "auto"` (the default) one per stage where a
        peer the job does not need serving has room, N N; a promotion, a standby replaced or
        serving again is in the job's history. Only where a stage's state is whole at every
        member (the plain rules): under rounds a replica holds its own, and none stands by (a
        warning where the job asked for some by number)."""
        standbys, asked = coordinator.membership.standbys, job.runtime.standby
        wanted = 1 if asked == "auto" else asked
        if wanted and not coordinator.rounds.readmits:
            if asked != "auto":
                log.warning("job %s: runtime.standby = %d: none under pool rounds", job_id, asked)
            wanted = 0
        standbys.wanted, standbys.only_spares = wanted, asked == "auto"
        standbys.min_replicas = self.assignments.floor(job)

        def domains(peer: str) -> Domains | None:  # one peer's, not every peer's: per pair
            announced, registry = self.peer_registry.peers.get(peer), self.peer_registry
            return domains_of(announced, registry.relayed(peer)) if announced else None

        def host(peer: str) -> str:
            known = domains(peer)
            return known.host if known is not None and known.host else f"peer:{peer}"

        def router(peer: str) -> str:
            known = domains(peer)
            return known.router if known is not None else ""

        def promoted(step: int, stage: int, peer: str) -> None:
            self.history.record(
                job_id,
                "promotion",
                f"{peer} promoted from standby to replica of stage {stage} at step {step}: it "
                "held the stage's state at the job's step, so nothing rolls back",
            )

        standbys.host, standbys.router = host, router
        standbys.vouched = lambda peer: self.vouched(job_id, peer)
        standbys.promoted.append(promoted)
        standbys.said.append(lambda stage, peer, text: self.history.record(job_id, "standby", text))

    def _step(self, job_id: str) -> int:
        record = self.store.get(job_id)
        return record.step if record else 0

    async def _save_final(self, job_id: str, step: int, state: dict[str, torch.Tensor]) -> None:
        """Save the final model until it is written. Until then the job is neither done nor
        failed: its coordinator and peers (the only other copy of the trained state) stay."""
        path = final_path(self.checkpoint_dir, job_id)
        backoff = Backoff(*self.final_save_retry_s)
        while True:
            try:
                # To its end even when the job is cancelled meanwhile: DeleteJob waits for it.
                await to_thread_to_the_end(save_final, path, step, state)
                return
            except OSError as e:  # CheckpointError: nothing is left under the final name
                pause = backoff.next()
                log.error(
                    "job %s: saving the final model to %s failed (errno %s): %s; retrying in "
                    "%.1f s",
                    job_id,
                    path,
                    _errno(e),
                    e,
                    pause,
                )
                try:
                    text = f"saving the final model failed: {e}; retrying in {pause:.0f} s"
                    await self.set_status(job_id, None, text)
                except StoreError as full:  # the store's disk may be the full one
                    log.error("job %s: %s", job_id, full)
                await asyncio.sleep(pause)


def _errno(error: BaseException) -> str:
    """The name of the errno behind `error` (a CheckpointError wraps what the write raised);
    "none" where the writer raised no OSError (torch.save's RuntimeError on a full disk)."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno:
            return errno.errorcode.get(cause.errno, str(cause.errno))
        cause = cause.__cause__ or cause.__context__
    return "none"


def _trainer_metrics(job_id: str) -> TrainerMetrics:
    # A registry of its own, not the scheduler's: each trainer creates its metric families, and a
    # second job's (or attempt's) in one registry would be a duplicate; so these go unscraped.
    return TrainerMetrics(job_id, registry=CollectorRegistry())


def routes_path(checkpoint_dir: Path, job_id: str) -> Path:
    """Where a `pool.mode = "local"` job's route record lies (`swarm.model.routes`)."""
    return checkpoint_dir / job_id / "routes.jsonl"


def final_path(checkpoint_dir: Path, job_id: str) -> Path:
    """Where a trained job's final model lies (`{"step": ..., "state": ...}`, torch.save)."""
    return checkpoint_dir / job_id / "final.pt"


def save_final(path: Path, step: int, state: dict[str, torch.Tensor]) -> None:
    """Write the final model to `path`: fsynced and renamed into place, so a torn file is never
    left under the final name (an export would read it, not the last checkpoint). A failed
    write raises `checkpoint.CheckpointError` (an OSError) with its partial file removed."""
    checkpoint.save_file(path, {"step": step, "state": state}, f"the final model (step {step})")
