"""The trainer: leases microbatches from the step coordinator and drives each through the stages,
choosing for every hop the replica with the smallest expected finish time (stochastic wiring).

A task `(step, index, stages)` goes forward through stages 0..S-2, forward-and-backward at S-1,
then backward down to the lowest stage it must accumulate at; Backward goes to the replica that did
the Forward at that stage (its activations are cached there). It reports, per stage, the replica
that accumulated its gradient. A failed hop is retried at once on another replica of the stage
(the failing one is banned with backoff); a microbatch that runs out of tries is handed back. An
accumulating call that failed without a refusal may have accumulated all the same: it is not
accumulated elsewhere, and its stage is left out of the report for the coordinator to settle.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from prometheus_client import CollectorRegistry

from swarm.bus.connection import Bus, BusLike
from swarm.clock import Clock, MonotonicClock
from swarm.errors import ActivationsNotCached, Busy, PeerUnavailable, RemoteError, SwarmError
from swarm.job.config import JobConfig
from swarm.model.data import VAL_STEP, DataSource, make_data, make_val_data
from swarm.ops.metrics import TrainerMetrics
from swarm.policy.backoff import Backoff
from swarm.policy.wiring import NoReplicaError, Wiring
from swarm.proto import control_pb2 as cpb
from swarm.proto import stage_pb2 as pb
from swarm.proto import tensor_pb2
from swarm.rpc.lease import Lease, LeaseSource, MicrobatchResult, Replica, Task
from swarm.rpc.stage_client import BackwardResult, Retiring, StageClient, TensorLike, named
from swarm.wire import codec

__all__ = ["ClientFactory", "PipelineTrainer", "TrainerError", "follow_load", "load_followed"]

log = logging.getLogger(__name__)
# How long a departed peer's metric series stay: several scrape intervals.
SERIES_GRACE_S = 300.0
T = TypeVar("T")


class TrainerError(SwarmError):
    """A microbatch cannot be completed: no replica of a stage could serve it."""


class ClientFactory(Protocol):
    """Makes the client of one replica: `StageClient` itself (tests give fakes)."""

    def __call__(
        self, address: str, job: JobConfig, job_id: str, stage: int, token: str | None, /
    ) -> StageClient: ...


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
        self._client_factory = client_factory
        self.job_id = job_id or job.fingerprint()
        self.trainer_id = trainer_id or f"trainer-{uuid.uuid4().hex[:8]}"
        self.data = data or make_data(job)
        # Only a trainer given validation work reads the validation data (a job's file, or
        # the tail of the data file), and it keeps it open from then on.
        self._val_data: DataSource | None = None
        self.metrics = metrics or TrainerMetrics(self.job_id)
        # A lease with no work waits at the coordinator up to this long (a long poll), and at
        # most a third of the lease timeout: each lease renews the leases of the work in flight.
        self.hop_attempts = hop_attempts
        self.lease_wait_s = min(lease_wait_s, job.runtime.lease_timeout_s / 3)
        self.leases = 0  # lease calls made (each one a round trip to the coordinator)
        self.clock = clock or MonotonicClock()
        self.wiring = Wiring(
            job.training.stages,
            clock=self.clock,
            rng=random.Random(seed),
            task_samples=job.training.microbatch_size,
        )
        self.clients: dict[str, StageClient] = {}
        self._members: list[set[str]] = [set() for _ in range(job.training.stages)]
        self._routes: list[pb.Route] = []  # per stage after the first: the push plane's route
        self._retiring = Retiring(job.runtime.rpc_timeout_s)
        self._departed: dict[str, float] = {}  # peer -> when it left, until its series go
        self._leased_step = -1  # the step of the last lease
        self.completed = 0  # microbatches this trainer computed and reported
        # (step, index) -> stage -> (its inputs, its output gradient or the targets), the bytes
        # this trainer sent: a lost gradient at one stage is replayed with one call from these.
        self._boundary: OrderedDict[tuple[int, int], dict[int, tuple[TensorLike, TensorLike]]] = (
            OrderedDict()
        )
        self._boundary_bytes = 0
        # Results not reported yet, each with its slot waiting for its next task; the one
        # report call in flight (`_report`)
        self._unreported: list[
            tuple[MicrobatchResult, asyncio.Future[Task | None], asyncio.Task[Any] | None]
        ] = []
        self._reporter: asyncio.Task[None] | None = None

    @property
    def val_data(self) -> DataSource:
        if self._val_data is None:
            self._val_data = make_val_data(self.job)
        return self._val_data

    async def close(self) -> None:
        await self._retiring.close()
        await asyncio.gather(*(c.close() for c in self.clients.values()))

    # -- membership -----------------------------------------------------------------------------
    def sync(self, replicas: list[list[Replica]]) -> None:
        """Follow the coordinator's view of who serves each stage: a peer may have left, moved
        to another stage (rebalancing) or come back at another address (restarted). A departed
        peer's client is closed (after its calls' deadline) and its metric series removed, so
        churn over days grows nothing. A lease without a view of the stages (the job not started
        yet) changes nothing."""
        if len(replicas) != len(self._members):
            return
        now = {r.peer: (stage, r) for stage, members in enumerate(replicas) for r in members}
        for members in self._members:
            for gone in members - now.keys():
                self.wiring.remove(gone)
        for gone in self.clients.keys() - now.keys():  # departed: nothing of it may stay
            self._retiring.retire(self.clients.pop(gone))
            self._departed[gone] = self.clock.now()
        self._forget_departed(now.keys())
        for peer, (stage, r) in now.items():
            if peer not in self._members[stage]:
                self.wiring.add(peer, stage, r.throughput or 1.0)  # leaves its old stage
            client = self.clients.get(peer)
            if client is None or (client.address, client.stage) != (r.address, stage):
                if client is not None:
                    self._retiring.retire(client)
                client = self._client_factory(r.address, self.job, self.job_id, stage, self.token)
                self.clients[peer] = client
        self._members = [{r.peer for r in members} for members in replicas]
        self._routes = [
            pb.Route(
                peers=[r.peer for r in members],
                addresses=[r.address for r in members],
                throughput=[r.throughput or 0.0 for r in members],
            )
            for members in replicas[1:]
        ]

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
                free = self.job.runtime.max_in_flight - len(running)
                if free == 0:
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
                for task in lease.tasks:
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
        lease = await self.coordinator.lease(self.trainer_id, count, wait_s=wait_s, working=working)
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
        try:
            result = await self._microbatch(task)
        except TrainerError as e:  # `_hop` handles every failed stage call itself
            log.warning(
                "%s: microbatch %d/%d failed: %s", self.trainer_id, task.step, task.index, e
            )
            # A release names indices only: one of an older step (a straggler) would give away
            # this trainer's lease on the same index of the step it works on now. (With
            # delayed_update the step before the leased one is live too.)
            live = self._leased_step - (1 if self.job.training.delayed_update else 0)
            if task.step >= live:
                await self.coordinator.release(self.trainer_id, [task.index])
            return None
        finally:
            self.metrics.in_flight.dec()
        waiter: asyncio.Future[Task | None] = asyncio.get_running_loop().create_future()
        self._unreported.append((result, waiter, asyncio.current_task()))
        if self._reporter is None or self._reporter.done():
            self._reporter = asyncio.create_task(self._report(running))
        return await waiter

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
            self.leases += 1
            try:
                lease = await self.coordinator.report_and_lease(
                    self.trainer_id, [r for r, _, _ in batch], len(batch), working=working
                )
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
    async def _hop(
        self, stage: int, call: Callable[[StageClient], Awaitable[T]], prefer: str | None = None
    ) -> tuple[str, T]:
        """Run `call` (it accumulates nothing) on a replica of `stage` (`prefer` first if
        eligible), retrying on others."""
        done = await self._attempts(stage, lambda c, _accumulate: call(c), prefer)
        assert done is not None  # only an accumulating hop gives up without an answer
        peer, result, _ = done
        return peer, result

    async def _accumulating_hop(
        self,
        stage: int,
        call: Callable[[StageClient, bool], Awaitable[T]],
        prefer: str | None = None,
        *,
        accumulate: bool,
        need_result: bool,
    ) -> tuple[str | None, T | None]:
        """Run `call(client, accumulate)` on a replica of `stage`, retrying on others. Returns
        the replica that accumulated the microbatch there (None when it did not, or when a call
        may have accumulated it but did not say so: see `_attempts`) and the answer (None when
        none was needed after such a call)."""
        done = await self._attempts(
            stage, call, prefer, accumulate=accumulate, need_result=need_result
        )
        if done is None:
            return None, None
        peer, result, accumulated = done
        return (peer if accumulated else None), result

    async def _attempts(
        self,
        stage: int,
        call: Callable[[StageClient, bool], Awaitable[T]],
        prefer: str | None,
        *,
        accumulate: bool = False,
        need_result: bool = True,
    ) -> tuple[str, T, bool] | None:
        """Up to `hop_attempts` tries of `call(client, accumulate)` on replicas of `stage`: the
        replica that answered, its answer, and whether that call accumulated.

        A failed accumulating call that may have accumulated all the same (`_may_have_landed`)
        is never accumulated elsewhere: a second receipt at the stage would void the first
        replica's step there. The tries left go on without accumulating (for the answer the
        next hop needs; None at once when it needs none), and the trainer reports the
        microbatch without this stage: the coordinator adopts the late receipt, or replays."""
        pool, samples = self.wiring[stage], self.job.training.microbatch_size
        last: BaseException | None = None
        for _ in range(self.hop_attempts):
            try:
                peer = prefer if prefer in pool.eligible() else pool.choose(samples)
            except NoReplicaError as e:
                raise TrainerError(f"stage {stage}: {e}") from last
            prefer = None
            pool.started(peer, samples)
            start = time.perf_counter()
            try:
                client = self.clients[peer]  # it may depart (sync) while the call runs
                result = await call(client, accumulate)
            except Busy as e:  # its queue is full (push): not its fault, try another
                pool.busy(peer, samples)
                last = e
                continue
            except SwarmError as e:  # the stage client raises nothing else for a failed call
                if peer in pool:  # it may have left (or moved stage) while the call ran
                    pool.failed(peer, samples)
                    self.metrics.failed(stage, peer)  # not for a departed peer: no new series
                last = e
                if accumulate and _may_have_landed(e):
                    accumulate = False
                    self.metrics.unreported.inc()
                    log.info(
                        "stage %d: %s failed (%r) and may have accumulated all the same; "
                        "reported without this stage",
                        stage,
                        peer,
                        e,
                    )
                    if not need_result:
                        return None
                    continue
                log.info("stage %d: %s failed (%r); trying another replica", stage, peer, e)
                continue
            # Service time, network included, queue at the replica excluded: the wiring adds
            # queued work itself, so counting the queue here would count it twice.
            queued = getattr(result, "queued_seconds", None)
            if queued is None:
                queued = client.last_queued_s
            if peer in pool:  # it may have left (or moved stage) while the call ran
                pool.finished(peer, samples, max(1e-6, time.perf_counter() - start - queued))
                self.metrics.routed(stage, peer, pool.throughput(peer))
            return peer, result, accumulate
        raise TrainerError(f"stage {stage}: {self.hop_attempts} attempts failed: {last}")

    async def _backward(
        self,
        client: StageClient,
        task: Task,
        stage: int,
        inputs: TensorLike,
        grad: TensorLike,
        cached_on: StageClient | None,
        accumulate: bool,
    ) -> BackwardResult:
        """Backward at `stage`; without re-sending the inputs when `client` did the forward
        (its activations are cached), with them if it no longer has them."""
        lowest = min(task.stages)
        kwargs = {"accumulate": accumulate, "need_grad_inputs": stage > lowest}
        if client is cached_on:
            try:
                return await client.backward(task.step, task.index, None, grad, **kwargs)
            except ActivationsNotCached:
                pass  # evicted there: resend with the inputs, and the replica recomputes
        return await client.backward(task.step, task.index, inputs, grad, **kwargs)

    def _remember(
        self, step: int, index: int, stage: int, inputs: TensorLike, grad: TensorLike
    ) -> None:
        # An old step's are useless (with delayed_update the step before is still live: a failed
        # round of its commit replays from them).
        live = step - 1 if self.job.training.delayed_update else step
        for old in [key for key in self._boundary if key[0] < live]:
            self._forget(old)
        self._boundary.setdefault((step, index), {})[stage] = (inputs, grad)
        self._boundary_bytes += _nbytes(inputs) + _nbytes(grad)
        while self._boundary_bytes > self.job.runtime.boundary_cache_bytes and self._boundary:
            self._forget(next(iter(self._boundary)))  # the oldest first

    def _forget(self, key: tuple[int, int]) -> None:
        for inputs, grad in self._boundary.pop(key, {}).values():
            self._boundary_bytes -= _nbytes(inputs) + _nbytes(grad)

    async def _replay_from_cache(self, task: Task) -> MicrobatchResult | None:
        """A replay whose stages' boundary tensors this trainer still has: one call per stage,
        on any replica (it recomputes from the same bytes, so the gradient is the same). A stage
        whose call may have accumulated without saying so is left out of the report."""
        cached = self._boundary.get((task.step, task.index))
        if cached is None or not task.stages <= cached.keys():
            return None
        last, holders = self.job.training.stages - 1, {}
        for k in sorted(task.stages):
            inputs, grad = cached[k]
            if k == last:
                peer, _ = await self._accumulating_hop(
                    k,
                    lambda c, a, i=inputs, g=grad: c.forward_backward(  # type: ignore[misc]
                        task.step, task.index, i, g, accumulate=a, need_grad_inputs=False
                    ),
                    accumulate=True,
                    need_result=False,
                )
            else:
                peer, _ = await self._accumulating_hop(
                    k,
                    lambda c, a, i=inputs, g=grad: c.backward(  # type: ignore[misc]
                        task.step, task.index, i, g, accumulate=a, need_grad_inputs=False
                    ),
                    accumulate=True,
                    need_result=False,
                )
            if peer is not None:
                holders[k] = peer
        self.metrics.cached_replays.inc()
        return MicrobatchResult(
            task.step, task.index, holders, None, self.job.training.microbatch_size
        )

    async def _push(self, task: Task) -> MicrobatchResult:
        """The push data plane: one call to a replica of the first stage carries the microbatch
        through every stage and back (`stage_server.pushing`); this trainer's link carries its
        tokens, targets and receipts only. Stages the answer names uncertain, or all of them when
        the call failed after it may have accumulated, are left out of the report: the
        coordinator adopts their late receipts or replays them."""
        step, index, stages = task.step, task.index, task.stages
        ids, labels = self.data.microbatch(step, index)
        inputs, targets = codec.encode(ids, "inputs"), codec.encode(labels, "targets")
        route, last = self._routes, self.job.training.stages - 1
        timeout = self.job.runtime.rpc_timeout_s * self.job.training.stages  # the whole path
        peer, result = await self._accumulating_hop(
            0,
            lambda c, a: c.push(
                step,
                index,
                inputs,
                targets,
                sorted(stages) if a else [],
                route,
                need_grad_inputs=False,
                timeout=timeout,
            ),
            accumulate=True,
            need_result=False,
        )
        if result is None:  # counted in `_attempts`, once for the whole path
            return MicrobatchResult(step, index, {}, None, int(ids.shape[0]))
        holders = {
            r.stage: r.peer
            for r in named(result.receipts, 0, peer or "")
            if r.stage in stages and r.stage not in result.uncertain
        }
        self.metrics.unreported.inc(len(stages) - len(holders))
        loss = result.loss_sum if last in holders else None
        return MicrobatchResult(step, index, holders, loss, int(ids.shape[0]))

    async def _evaluate(self, task: Task) -> MicrobatchResult:
        """A validation microbatch: forward only through every stage (on either data plane), its
        loss reported; nothing accumulates, so any failed hop is simply tried elsewhere."""
        step, index = task.step, task.index
        ids, labels = self.val_data.microbatch(
            VAL_STEP, index - self.job.training.microbatches_per_step
        )
        inputs, targets = codec.encode(ids, "inputs"), codec.encode(labels, "targets")
        last = self.job.training.stages - 1
        if self.job.runtime.data_plane == "push":
            route, timeout = self._routes, self.job.runtime.rpc_timeout_s * (last + 1)
            _, pushed = await self._hop(
                0,
                lambda c: c.push(
                    step,
                    index,
                    inputs,
                    targets,
                    [],
                    route,
                    need_grad_inputs=False,
                    timeout=timeout,
                    evaluate=True,
                ),
            )
            loss = pushed.loss_sum
        else:
            x: TensorLike = inputs
            for k in range(last):
                _, x = await self._hop(k, functools.partial(_forward_only, step, index, x))
            _, loss = await self._hop(last, lambda c: c.evaluate(step, index, x, targets))
        return MicrobatchResult(step, index, {}, loss, int(ids.shape[0]))

    async def _microbatch(self, task: Task) -> MicrobatchResult:
        if task.evaluate:
            return await self._evaluate(task)
        if self.job.runtime.data_plane == "push":
            return await self._push(task)
        if len(task.stages) < self.job.training.stages:  # a replay
            replayed = await self._replay_from_cache(task)
            if replayed is not None:
                return replayed
        step, index, stages = task.step, task.index, task.stages
        last, lowest = self.job.training.stages - 1, min(task.stages)
        ids, labels = self.data.microbatch(step, index)
        # Encoded once; every later hop passes on the messages the stages sent back.
        boundary: list[TensorLike] = [codec.encode(ids, "inputs")]
        targets = codec.encode(labels, "targets")
        forward_peer: dict[int, str] = {}
        for k in range(last):
            peer, out = await self._hop(k, lambda c, k=k: c.forward(step, index, boundary[k]))  # type: ignore[misc]
            forward_peer[k] = peer
            boundary.append(out)
        # Each accumulating hop reports its stage only where it surely accumulated there; after
        # a call that may have, it goes on without accumulating (see `_attempts`).
        holders: dict[int, str] = {}
        holder, result = await self._accumulating_hop(
            last,
            lambda c, a: c.forward_backward(
                step, index, boundary[last], targets, accumulate=a, need_grad_inputs=lowest < last
            ),
            accumulate=last in stages,
            need_result=lowest < last,
        )
        if holder is not None:
            holders[last] = holder
        self._remember(step, index, last, boundary[last], targets)
        # The loss is the same whichever replica computed it, accumulating or not.
        loss = result.loss_sum if last in stages and result is not None else None
        grad = result.grad_inputs if result is not None else None
        for k in range(last - 1, lowest - 1, -1):
            assert grad is not None
            g, forward_client = grad, self.clients.get(forward_peer[k])  # None: it departed
            self._remember(step, index, k, boundary[k], g)
            holder, result = await self._accumulating_hop(
                k,
                lambda c, a, k=k, g=g, f=forward_client: self._backward(  # type: ignore[misc]
                    c, task, k, boundary[k], g, f, a
                ),
                prefer=forward_peer[k],
                accumulate=k in stages,
                need_result=k > lowest,
            )
            if holder is not None:
                holders[k] = holder
            grad = result.grad_inputs if result is not None else None
        return MicrobatchResult(step, index, holders, loss, int(ids.shape[0]))


async def _forward_only(
    step: int, index: int, inputs: TensorLike, client: StageClient
) -> tensor_pb2.Tensor:
    return await client.forward(step, index, inputs, evaluate=True)


def _may_have_landed(error: SwarmError) -> bool:
    """Whether a failed accumulating call may have accumulated all the same: the replica did not
    answer (a deadline, a dropped connection: `PeerUnavailable`) or answered with an error of its
    own (`RemoteError`: a bug there, perhaps after accumulating). A refusal (`WireError`: a stale
    step, a bad request, activations not cached) says it took nothing."""
    return isinstance(error, PeerUnavailable | RemoteError)


async def follow_load(bus: BusLike, job_id: str, wiring: Wiring, microbatch_size: int) -> None:
    """Merge the load reports replicas publish on MQTT into `wiring` (until cancelled)."""
    async for _topic, message in bus.subscribe(bus.topics.load(job_id, "+")):
        if isinstance(message, cpb.LoadReport):
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


def _nbytes(value: TensorLike) -> int:
    if isinstance(value, tensor_pb2.Tensor):
        return len(value.data)
    return value.numel() * value.element_size()
