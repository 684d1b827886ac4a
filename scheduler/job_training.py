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
from dataclasses import dataclass
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
from scheduler.coordinator.trust.standing import Ban
from scheduler.failure_domains import domains_of
from scheduler.history import History
from scheduler.rebalance_loop import Mover
from scheduler.registry import PeerRegistry
from scheduler.speed import RecentSpeed
from scheduler.stalls import Health, StallWatch
from scheduler.store import JobState, JobStore, StoreError
from scheduler.stored_bans import StoredBans
from swarm.bus.connection import BusLike
from swarm.job.config import JobConfig
from swarm.job.rule import rule_of
from swarm.model import checkpoint
from swarm.model.routes import write_record
from swarm.net.commit_auth import SchedulerKey
from swarm.ops.progress import StepRecord
from swarm.policy.backoff import Backoff
from swarm.proto import control_pb2 as cpb

__all__ = ["NEWS_SAID_STEPS", "JobTraining", "final_path", "save_final"]

# News (a rollback, a replica left out, a stage served again) stays the job's message for this
# many committed steps; then "training" again (the job's events keep it). Issue 51: only the
# rollback's went, the rest stayed the message long after its event ended.
NEWS_SAID_STEPS = 20


@dataclass(slots=True)
class _News:
    """The job's message while it trains, and the step it was first seen at: once
    `NEWS_SAID_STEPS` steps have committed under the same words, it is history."""

    text: str = ""
    since: int = 0

    def aged(self, message: str, step: int) -> bool:
        """Whether `message`, seen now at `step`, has outlived its event."""
        if message in ("", "training"):
            self.text = ""
            return False
        if message != self.text:
            self.text, self.since = message, step
            return False
        return step >= self.since + NEWS_SAID_STEPS


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

        async def committed(record: StepRecord) -> None:
            if record.val_loss is not None:
                log.info(
                    "job %s validation loss %.4f after %d steps",
                    job_id,
                    record.val_loss,
                    record.step,
                )
                try:
                    self.store.record_eval(job_id, record.step, record.val_loss)
                except StoreError as e:  # a full disk: the next evaluation says it anew
                    log.error("job %s: %s", job_id, e)
            if record.final_evaluation:
                await self.announce(job_id)
                return
            try:
                self.store.record_step(
                    job_id, record.step, record.loss, record.samples, record.seconds
                )
            except StoreError as e:  # a full disk: the store writes it with the next step
                log.error("job %s: %s", job_id, e)
            speed.committed(record.samples)
            log.debug("job %s step %d loss %.4f", job_id, record.step, record.loss)
            if said and record.step >= rolled[-1] + NEWS_SAID_STEPS:
                # The rollback is history now (its event stays): the message says what is.
                if self._message(job_id) == said[-1]:
                    await self.set_status(job_id, None, "training")
                said.clear()
            elif news.aged(self._message(job_id), record.step):
                # Steps commit, so whatever the message told of has passed: say what is.
                await self.set_status(job_id, None, "training")
            await self.bus.publish(
                self.bus.topics.steps(job_id),
                cpb.StepCommitted(
                    job=job_id,
                    step=record.step,
                    loss=record.loss,
                    samples=record.samples,
                    time=time.time(),
                    val_loss=record.val_loss,
                ),
                retain=True,
            )
            await self.announce(job_id)

        stages, mb = job.training.stages, job.training.microbatch_size
        speed = self.speed.setdefault(job_id, RecentSpeed(time.time))

        said: list[str] = []  # what a rollback told `swarm status`, kept past the start
        news = _News()  # any other message said while steps commit
        rolled: list[int] = []  # the steps rolled back to
        # peers banned since the last rollback (its cause then); those kept whose rollback
        # never ran (the scheduler stopped first) roll back at this attempt's first lease
        bans = [ban.peer for ban in self.store.bans(job_id) if not ban.replayed]

        async def rolled_back(step: int) -> None:
            self.store.rewind(job_id, step)
            rolled.append(step)
            speed.start()  # training starts again now: the stall is not its speed
            cause = f"{', '.join(bans)} banned" if bans else "a stage lost every replica"
            missed = coordinator.membership.standbys.missed
            if missed and not bans:  # why no standby took the stage: the rollback names it
                cause = f"{cause}: {missed}"
            bans.clear()
            said.append(
                f"rolled back to step {step}: {cause}; training from the last checkpoint"
                if step
                else f"rolled back to step 0 (no checkpoint): {cause}; training again from the"
                " start"
            )
            self.history.record(job_id, "rollback", said[-1])
            await self.set_status(job_id, None, said[-1])

        async def status(text: str) -> None:  # the coordinator's: a replica left out, a replay
            self.history.record(job_id, "commit", text)
            await self.set_status(job_id, None, text)

        async def banned(ban: Ban) -> None:  # a peer an audit caught lying, with the evidence
            bans.append(ban.peer)
            self.history.record(job_id, "ban", ban.text)
            await self.set_status(job_id, None, ban.text)

        routes = None
        if rule_of(job).records_routes:  # appended: a resumed job's record goes on
            path = routes_path(self.checkpoint_dir, job_id)
            path.parent.mkdir(parents=True, exist_ok=True)
            routes = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed below)
        coordinator = LocalCoordinator(
            job,
            job_id,
            lambda: self.peer_registry.members(job_id, stages),
            token=self.token,
            connect=grpc_replicas(job, job_id, self.token, self.signing),
            on_step=committed,
            checkpoint_dir=self.checkpoint_dir / job_id,
            on_rollback=rolled_back,
            on_status=status,
            on_ban=banned,
            bans=StoredBans(self.store, job_id, self.bans_bind_credentials),  # kept across restarts
            metrics=CoordinatorMetrics(job_id, families=self.coordinator_metrics),
            on_route=None if routes is None else (lambda r: write_record(routes, [r])),
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
        self._stand_by(job_id, job, coordinator)
        trainer = PipelineTrainer(
            job,
            coordinator,
            job_id=job_id,
            token=self.token,
            trainer_id=f"{job_id}-embedded",
            metrics=_trainer_metrics(job_id),
        )
        try:
            self.store.resume(job_id, await coordinator.start())  # a re-run replaces old rows
            self.coordinators[job_id] = coordinator
            speed.start()
            await self.set_status(job_id, "running", said[-1] if said else "training")
            floor = self.assignments.floor(job)
            mover = Mover(
                job_id,
                stages,
                job.rebalance,
                self.assignments,
                self.moves,
                floor,
                coordinator.membership.standbys.peers,
            )
            watch = StallWatch(
                job_id,
                lambda: self.peer_registry.members(job_id, stages),
                lambda: self._step(job_id),
                coordinator.recovery.latest,
                lambda text, state: self.set_status(job_id, state, text),
                lambda: self._message(job_id),
                self.history,
                self.health(job_id),
                speed=speed,
                progress=coordinator.progress,
                refill=mover.refill,
                min_replicas=floor,
                counted=coordinator.replicas,
                lost=lambda missing: self.peer_registry.lost_relays(job_id, missing),
                domains=self.peer_registry.domains,
                cause=lambda: trainer.failure,  # the embedded trainer's (issue 63)
                patience_s=job.runtime.patience_s,
            )
            try:
                async with asyncio.TaskGroup() as group:
                    helpers = [  # stopped when the job ends
                        group.create_task(self.assignments.grow(job_id, stages, assigned, floor)),
                        group.create_task(follow_load(self.bus, job_id, trainer.wiring, mb)),
                        group.create_task(watch.run()),
                    ]
                    if job.rebalance.enabled:
                        helpers.append(group.create_task(mover.run()))
                    if self.embedded_trainer:
                        group.create_task(trainer.run())
                    await coordinator.finished.wait()
                    for helper in helpers:
                        helper.cancel()
            except ExceptionGroup as failed:
                # One child's error, unwrapped, so the scheduler tells one worth retrying (a
                # peer gone, a broker hiccup) from a bug.
                raise failed.exceptions[0] from failed
            if coordinator.error:
                raise coordinator.error
            state = await gather_state(coordinator)
            await self._save_final(job_id, job.training.steps, state)
        finally:
            self.coordinators.pop(job_id, None)
            await trainer.close()
            await coordinator.close()
            if routes is not None:
                routes.close()

    def _stand_by(self, job_id: str, job: JobConfig, coordinator: LocalCoordinator) -> None:
        """The job's standbys (`scheduler.coordinator.standbys`), each on a host none of its
        stage's replicas is on; a promotion is in the job's history. Only where a stage's state
        is whole at every member (the plain rules): under rounds a replica holds its own."""
        standbys, wanted = coordinator.membership.standbys, job.runtime.standby
        if wanted and not coordinator.rounds.readmits:
            log.warning("job %s: runtime.standby = %d: none under pool rounds", job_id, wanted)
            wanted = 0
        standbys.wanted = wanted

        def host(peer: str) -> str:  # one peer's, not every peer's domains: asked per pair
            announced, registry = self.peer_registry.peers.get(peer), self.peer_registry
            domains = domains_of(announced, registry.relayed(peer)) if announced else None
            return domains.host if domains is not None and domains.host else f"peer:{peer}"

        def promoted(step: int, stage: int, peer: str) -> None:
            self.history.record(
                job_id,
                "promotion",
                f"{peer} promoted from standby to replica of stage {stage} at step {step}: it "
                "held the stage's state at the job's step, so nothing rolls back",
            )

        standbys.host = host
        standbys.promoted.append(promoted)

    def _step(self, job_id: str) -> int:
        record = self.store.get(job_id)
        return record.step if record else 0

    def _message(self, job_id: str) -> str:
        record = self.store.get(job_id)
        return record.message if record else ""

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
