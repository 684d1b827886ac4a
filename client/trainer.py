"""The trainer: leases microbatches from the step coordinator, runs each through the stages on
its data plane (`client.data_plane`: carry or push), and reports, per stage, the replica that
accumulated its gradient. It follows the coordinator's view of every stage's members (each lease
carries it) and, given a broker, the replicas' load reports, so its wiring chooses for every hop
the replica with the smallest expected finish time (stochastic wiring). A microbatch whose hops
ran out of replicas is handed back to the coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from client.data_plane.hops import StageHops, TrainerError
from client.data_plane.plane import DataPlane, make_plane
from client.metrics import TrainerMetrics
from swarm.bus.connection import Bus, BusLike
from swarm.clock import Clock, MonotonicClock
from swarm.errors import SwarmError
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.job.rule import rule_of
from swarm.model.data import VAL_STEP, DataSource, make_data, make_val_data
from swarm.ops import timeline
from swarm.ops.rated import RatedLog
from swarm.policy.backoff import Backoff
from swarm.policy.window import window
from swarm.policy.wiring import Wiring
from swarm.proto import control_pb2 as cpb
from swarm.rpc import epoch
from swarm.rpc.causes import FAILURE_LOG_S, kind
from swarm.rpc.lease import Lease, LeaseSource, MicrobatchResult, Replica, Task
from swarm.rpc.route_clients import Retiring, RouteClients
from swarm.rpc.routes import ClientFactory, Routes
from swarm.rpc.stage_client import StageClient

__all__ = ["ClientFactory", "PipelineTrainer", "TrainerError", "follow_load", "load_followed"]

log = logging.getLogger(__name__)
# How long a departed peer's metric series stay: several scrape intervals.
SERIES_GRACE_S = 300.0


class PipelineTrainer:
    def __init__(
        self,
        job: JobConfig,
        coordinator: LeaseSource,
        *,
        job_id: str | None = None,
        trainer_id: str | None = None,
        data: DataSource | None = None,
        metrics: TrainerMetrics | None = None,
        token: str | None = None,
        hop_attempts: int = 4,
        lease_wait_s: float = 10.0,
        seed: int | None = None,
        clock: Clock | None = None,
        client_factory: ClientFactory = StageClient,
    ) -> None:
        self.job, self.coordinator, self.token = job, coordinator, token
        self.job_id = job_id or fingerprint(job)
        self.trainer_id = trainer_id or f"trainer-{uuid.uuid4().hex[:8]}"
        self.data = data or make_data(job)
        # Only a trainer given validation work reads the validation data (a job's file, or
        # the tail of the data file), and it keeps it open from then on.
        self._val_data: DataSource | None = None
        self.metrics = metrics or TrainerMetrics(self.job_id)
        # A lease with no work waits at the coordinator up to this long (a long poll), and at
        # most a third of the lease timeout: each lease renews the leases of the work in flight.
        self.lease_wait_s = min(lease_wait_s, job.runtime.lease_timeout_s / 3)
        self.leases = 0  # lease calls made (each one a round trip to the coordinator)
        self.clock = clock or MonotonicClock()
        wiring = Wiring(
            job.training.stages,
            clock=self.clock,
            rng=random.Random(seed),
            task_samples=job.training.microbatch_size,
        )
        self.routes = Routes(job, self.job_id, token, wiring, client_factory)
        self.hops = StageHops(self.routes, hop_attempts, self.metrics)
        # a push-plane audit that ends after its microbatch's report sends what it found so
        self.plane: DataPlane = make_plane(job, self.hops, self.metrics, self._report_late)
        self._departed: dict[str, float] = {}  # peer -> when it left, until its series go
        self._leased_step = -1  # the step of the last lease
        self._failing = Backoff(first_s=0.05, cap_s=2.0)  # the pause before a `_give_back`
        # Why the last microbatch failed, until one goes through again: what a job that stops
        # progressing names as its cause (`client.patience`, the scheduler's stall watch).
        self.failure: str | None = None
        self.failed_at = 0.0  # when (monotonic) `failure` came: one long ago is not failing now
        # Once a rate window for each cause: a stage that refuses everything fails every slot's
        # microbatch every few seconds, each line naming the same cause.
        self._failed_log = RatedLog(log, FAILURE_LOG_S)
        self.completed = 0  # microbatches this trainer computed and reported
        # Results not reported yet, each with its slot waiting for its next task; the one
        # report call in flight (`_report`)
        self._unreported: list[
            tuple[MicrobatchResult, asyncio.Future[Task | None], asyncio.Task[Any] | None]
        ] = []
        self._reporter: asyncio.Task[None] | None = None
        self.window = window(job, [])  # microbatches kept in flight: sized anew at each `sync`
        self.metrics.window.set(self.window)

    @property
    def val_data(self) -> DataSource:
        if self._val_data is None:
            self._val_data = make_val_data(self.job)
        return self._val_data

    @property
    def wiring(self) -> Wiring:
        return self.routes.wiring

    @property
    def clients(self) -> RouteClients:
        return self.routes.clients

    @property
    def _retiring(self) -> Retiring:
        return self.routes.retiring

    async def close(self) -> None:
        # The push plane's late audits first: none then calls an auditor over a closed client,
        # or reports to a coordinator this trainer has left.
        await self.plane.stop()
        await self.routes.close()

    # -- membership -----------------------------------------------------------------------------
    def sync(self, replicas: list[list[Replica]]) -> None:
        """Follow the coordinator's view of who serves each stage: a peer may have left, moved
        to another stage (rebalancing) or come back at another address (restarted). A departed
        peer's client is closed (after its calls' deadline) and its metric series removed, so
        churn over days grows nothing. A lease without a view of the stages (the job not started
        yet) changes nothing."""
        if len(replicas) != self.job.training.stages:
            return
        self.window = window(self.job, [[r.capacity for r in stage] for stage in replicas])
        self.metrics.window.set(self.window)
        for gone in self.routes.follow_all(replicas):
            self._departed[gone] = self.clock.now()
        self._forget_departed({r.peer for members in replicas for r in members})
        self.plane.follow(replicas)

    def _forget_departed(self, present: Iterable[str]) -> None:
        """Remove the metric series of peers gone for `SERIES_GRACE_S`: not at once, so that
        scrapes see a departed peer's final counts (a counter removed between two scrapes loses
        its last increments), yet over days of churn the series stay bounded."""
        for peer in present:
            self._departed.pop(peer, None)  # back again: its series go on
        expired = self.clock.now() - SERIES_GRACE_S
        for peer in [p for p, when in self._departed.items() if when <= expired]:
            del self._departed[peer]
            self.metrics.forget(peer)

    # -- the loop -------------------------------------------------------------------------------
    async def run(self) -> None:
        """Lease and train until the coordinator says the job is done.

        With a free slot, the trainer asks for work in a long poll (the coordinator answers when
        there is some); with every slot busy, it waits for one to finish. Either way the leases
        of its work in flight are renewed at least every `lease_wait_s`, so a slow pipeline
        keeps them. An empty answer that came back early (a job not started yet, the members
        changed) is asked again after a pause that backs off."""
        running: dict[asyncio.Task[None], Task] = {}
        idle = Backoff(first_s=0.05, cap_s=1.0)
        loop = asyncio.get_running_loop()
        try:
            while True:
                for finished in [t for t in running if t.done()]:
                    del running[finished]
                    finished.result()  # surface bugs; hop failures were handled inside
                free = self.window - len(running)  # < 0 once it shrank: slots end as they report
                if free <= 0:
                    done, _ = await asyncio.wait(
                        running, timeout=self.lease_wait_s, return_when=asyncio.FIRST_COMPLETED
                    )
                    if not done:  # every slot still busy: renew what they work on
                        await self._lease(0, 0.0, running)
                    continue
                started = loop.time()
                lease = await self._lease(free, self.lease_wait_s, running)
                if lease.done:
                    if running:
                        await asyncio.wait(running)  # their reports are moot, their ends not
                        for finished in running:
                            finished.result()
                    return
                if len(lease.tasks) > free:  # no coordinator gives more than it is asked for
                    self._failed_log.warning(
                        "lease",
                        "%s: asked for %d microbatches, given %d: the rest left to expire",
                        self.trainer_id,
                        free,
                        len(lease.tasks),
                    )
                for task in lease.tasks[:free]:
                    running[asyncio.create_task(self._run_tasks(task, running))] = task
                if lease.tasks:
                    idle.reset()
                    continue
                pause = idle.next() - (loop.time() - started)
                if pause > 0:
                    await asyncio.sleep(pause)
        finally:
            for pending in running:
                pending.cancel()
            if self._reporter is not None:
                self._reporter.cancel()

    async def _lease(
        self, count: int, wait_s: float, running: dict[asyncio.Task[None], Task]
    ) -> Lease:
        working = [(t.step, t.index) for job, t in running.items() if not job.done()]
        self.leases += 1
        start = timeline.now()
        lease = await self.coordinator.lease(self.trainer_id, count, wait_s=wait_s, working=working)
        timeline.span("lease", start, timeline.now(), got=len(lease.tasks))
        self._leased_step = lease.step
        self.sync(lease.replicas)
        return lease

    async def _run_tasks(self, first: Task, running: dict[asyncio.Task[None], Task]) -> None:
        """Run `first`, then each next task the coordinator gives back with a report: a slot
        that keeps busy costs one round trip per microbatch, not a report and a lease."""
        me = asyncio.current_task()
        assert me is not None
        task: Task | None = first
        while task is not None:
            running[me] = task  # what this slot works on, for the renewals of `_lease`
            task = await self._run_task(task, running)

    async def _run_task(
        self, task: Task, running: dict[asyncio.Task[None], Task] | None = None
    ) -> Task | None:
        """Run `task` and report it, asking for the next one in the same call (renewing the
        leases of the other slots' work, `running`); returns it."""
        running = running or {}
        self.metrics.in_flight.inc()
        start = timeline.now()
        try:
            result: MicrobatchResult | None = await self._microbatch(task)
        except TrainerError as e:  # the hop loop handled every failed stage call itself
            self.failure, self.failed_at = str(e), time.monotonic()
            self._failed_log.warning(
                kind(self.failure),
                "%s: microbatch %d/%d failed: %s",
                self.trainer_id,
                task.step,
                task.index,
                e,
            )
            result = None
        finally:
            self.metrics.in_flight.dec()
            timeline.span("microbatch", start, timeline.now(), at=[task.step, task.index])
        if result is None:
            await self._give_back(task)
            return None
        self._failing.reset()
        self.failure = None
        waiter: asyncio.Future[Task | None] = asyncio.get_running_loop().create_future()
        self._unreported.append((result, waiter, asyncio.current_task()))
        if self._reporter is None or self._reporter.done():
            self._reporter = asyncio.create_task(self._report(running))
        return await waiter

    async def _report_late(self, result: MicrobatchResult) -> None:
        """An audit's own report, after its microbatch's (`client.audit.late_audits`)."""
        await self.coordinator.report(self.trainer_id, result)

    async def _give_back(self, task: Task) -> None:
        """Release a microbatch that failed, after a pause: one that fails at once (a stage's
        every replica in backoff for a while) would come back within milliseconds. It stays leased
        to this slot meanwhile, not in flight."""
        await asyncio.sleep(self._failing.next())
        # A release names indices only: one of an older step (a straggler) would give away
        # this trainer's lease on the same index of the step it works on now. (With
        # delayed_update the step before the leased one is live too.)
        live = self._leased_step - (1 if rule_of(self.job).delays else 0)
        if task.step >= live:
            await self.coordinator.release(self.trainer_id, [task.index], self.failure)

    async def _report(self, running: dict[asyncio.Task[None], Task]) -> None:
        """Report what finished, asking for as many next tasks, one call in flight at a time:
        results that finish meanwhile go together in the next call. A scheduler that keeps up
        sees one call per microbatch; a busy one, fewer and larger calls (its cost is per call)."""
        while self._unreported:
            batch, self._unreported = self._unreported, []
            slots = {slot for _, _, slot in batch}
            working = [
                (t.step, t.index)
                for job, t in running.items()
                if job not in slots and not job.done()
            ]
            # a next task for each slot reported, within the window (it may have shrunk)
            wanted = max(0, min(len(batch), self.window - len(working)))
            self.leases += 1
            start = timeline.now()
            try:
                lease = await self.coordinator.report_and_lease(
                    self.trainer_id, [r for r, _, _ in batch], wanted, working=working
                )
                timeline.span("report", start, timeline.now(), got=len(lease.tasks))
            except asyncio.CancelledError:
                for _, waiter, _ in batch:
                    waiter.cancel()
                raise
            except Exception as e:  # each slot's runner raises it (the trainer stops with it)
                for _, waiter, _ in batch + self._unreported:
                    if not waiter.done():
                        waiter.set_exception(e)
                self._unreported = []
                return
            self.metrics.microbatches.inc(len(batch))
            self.completed += len(batch)
            self._leased_step = lease.step
            self.sync(lease.replicas)
            tasks = [] if lease.done else list(lease.tasks)
            for i, (_, waiter, _) in enumerate(batch):
                if not waiter.done():
                    waiter.set_result(tasks[i] if i < len(tasks) else None)

    # -- one microbatch -------------------------------------------------------------------------
    async def _microbatch(self, task: Task) -> MicrobatchResult:
        # Its stage calls carry its epoch (a rollback since retires them: `swarm.rpc.epoch`), and
        # its accumulating ones its tickets (a replica the scheduler placed asks for them).
        epoch.leased_in(task.epoch, task.tickets)
        if task.evaluate:
            ids, labels = self.val_data.microbatch(
                VAL_STEP, task.index - self.job.training.microbatches_per_step
            )
            return await self.plane.evaluate(task, ids, labels)
        return await self.plane.train(task, self.data)


async def follow_load(bus: BusLike, job_id: str, wiring: Wiring, microbatch_size: int) -> None:
    """Merge the load reports replicas publish on MQTT for `job_id` into `wiring` (until
    cancelled). A peer's load topic carries whichever job it serves: the report names it."""
    async for _topic, message in bus.subscribe(bus.topics.load("+")):
        if isinstance(message, cpb.LoadReport) and message.job == job_id:
            seconds = message.ema_seconds_per_sample
            wiring.report_load(
                message.peer,
                message.queue_depth * microbatch_size,
                seconds if seconds > 0 else None,
            )


@contextlib.asynccontextmanager
async def load_followed(
    broker: str | None,
    job_id: str,
    trainers: Sequence[PipelineTrainer],
    *,
    token: str | None = None,
    registry: CollectorRegistry | None = None,
) -> AsyncIterator[None]:
    """While inside, each trainer's wiring follows the job's load reports from `broker` (the
    trainers outside the scheduler; nothing without a broker). The bus connects and reconnects in
    the background: a broker that is down or refuses us costs the wiring its reports (it still
    measures what it sends itself), never the training."""
    if broker is None or not trainers:
        yield
        return

    async def follow(trainer: PipelineTrainer) -> None:
        try:
            await follow_load(bus, job_id, trainer.wiring, trainer.job.training.microbatch_size)
        except SwarmError as e:
            log.warning("%s: no load reports from %s: %s", trainer.trainer_id, broker, e)

    client_id = f"{trainers[0].trainer_id}-load"
    async with Bus(broker, client_id, token=token, registry=registry or CollectorRegistry()) as bus:
        tasks = [asyncio.create_task(follow(t)) for t in trainers]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
