"""A trainer outside the scheduler: `swarm trainer --scheduler ADDR --job ID`. It leases the
job's microbatches over the job API (`RemoteCoordinator`) and trains them like the embedded one;
several may train one job together, and a trainer that disappears has its leases re-issued."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

import grpc
import torch
from tqdm import tqdm

from client.job_data import local_data
from client.metrics import TrainerMetrics
from client.patience import Patience, bounded
from client.trainer import PipelineTrainer, load_followed
from swarm.alongside import alongside
from swarm.errors import ConfigError, PeerUnavailable
from swarm.job.config import parse_job, verify_init
from swarm.net import dial
from swarm.net.invite import cache_dir
from swarm.net.submitters import SUBMITTER_KEY
from swarm.net.tls_mismatch import explain_grpc
from swarm.ops.metrics import serve_metrics
from swarm.policy.backoff import Backoff
from swarm.proto import scheduler_pb2 as spb
from swarm.proto import scheduler_pb2_grpc
from swarm.rpc.cache_room import Uses
from swarm.rpc.init_fetch import is_local
from swarm.rpc.lease import (
    Lease,
    MicrobatchResult,
    Working,
    lease_from_proto,
    lease_request,
    result_to_proto,
)
from swarm.rpc.status import from_rpc_error
from swarm.wire.chunking import grpc_options

__all__ = ["Failing", "RemoteCoordinator", "run_patiently", "run_remote_trainer"]

log = logging.getLogger(__name__)

R = TypeVar("R")

#: Seconds a data file's download may take in all (a home link: 1 GB at 20 Mbit/s is 400 s).
FETCH_TIMEOUT_S = 3600.0


def _at_its_cap(error: grpc.RpcError) -> bool:
    """Whether the scheduler refused the call for its cap of calls in progress (gRPC's
    `maximum_concurrent_rpcs`), not for the call itself."""
    return error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "Concurrent RPC limit" in (
        error.details() or ""
    )


class RemoteCoordinator:
    """The scheduler's step coordinator, over gRPC."""

    def __init__(
        self,
        address: str,
        job_id: str,
        *,
        token: str | None = None,
        submitter_token: str | None = None,
        timeout_s: float = 30.0,
        retry_for_s: float = 600.0,
    ) -> None:
        """`submitter_token`: the job's submitter's (or the admin's credential), which makes
        this trainer one of the job's own: only those are told the step's contribution audits
        (docs/jobs.md, "Trust"); another trains the job with its contributions unaudited.
        `retry_for_s`: how long a call keeps asking a scheduler that does not answer (one
        restarting, upgraded, or on the far side of a network outage) before the trainer gives
        up; the trainer's leases outlive a short outage only if the scheduler's lease timeout
        does too, but its work is replayed exactly either way."""
        self.address, self.job_id = address, job_id
        self.timeout_s, self.retry_for_s = timeout_s, retry_for_s
        # Its own, for its lifetime: the job API binds each trainer id it names to it
        # (`scheduler.trainer_keys`), so no other caller speaks for its leases.
        self.key = os.urandom(32)
        self._metadata = ((SUBMITTER_KEY, submitter_token),) if submitter_token else None
        self.channel = dial.channel(address, token=token, options=grpc_options(64 << 20))
        self.stub = scheduler_pb2_grpc.SchedulerServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def _call(self, what: str, rpc: Callable[[], Awaitable[R]]) -> R:
        """`rpc()`, asked again with backoff while the scheduler is unreachable (for at most
        `retry_for_s`); its errors are `swarm.errors` (`from_rpc_error`). Repeating is safe: a
        report or release twice is the same as once, and a lease whose reply was lost expires and
        goes to a trainer again."""
        backoff, give_up = Backoff(first_s=0.2, cap_s=5.0), time.monotonic() + self.retry_for_s
        while True:
            try:
                return await rpc()
            except grpc.RpcError as e:
                error, delay = from_rpc_error(e), backoff.next()
                # A scheduler restarting, or too busy to answer in time (or at its cap of calls
                # in progress: a stage lost, every trainer's slots give work back at once), is
                # worth asking again. Anything else (an unknown job, a refused token, a request
                # too large) is final, and so is TLS on one side only: asking again cannot
                # change either side's flags.
                if isinstance(error, PeerUnavailable):
                    hint = explain_grpc(self.address, e.details() or "", "the scheduler")
                    if hint is not None:
                        raise ConfigError(hint) from e
                again = isinstance(error, PeerUnavailable) or _at_its_cap(e)
                if not again or time.monotonic() + delay > give_up:
                    raise error from e
            log.warning("scheduler: %s failed (%s); asking again", what, error)
            await asyncio.sleep(delay)

    async def job(self) -> spb.JobStatus:
        request = spb.SchedulerGetJobRequest(job=self.job_id)
        response = await self._call(
            "GetJob", lambda: self.stub.GetJob(request, timeout=self.timeout_s)
        )
        return response.job

    async def fetch_data(self, validation: bool, offset: int = 0) -> AsyncIterator[bytes]:
        """The job's data file (its validation file) from the scheduler, in chunks, from byte
        `offset` on."""
        request = spb.SchedulerFetchDataRequest(
            job=self.job_id, validation=validation, offset=offset
        )
        try:
            async for part in self.stub.FetchData(request, timeout=FETCH_TIMEOUT_S):
                yield part.data
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e

    async def lease(
        self, trainer: str, count: int, *, wait_s: float = 0.0, working: Sequence[Working] = ()
    ) -> Lease:
        request = lease_request(self.job_id, trainer, count, wait_s, working)
        request.trainer_key = self.key
        # A long poll: the deadline covers the wait as well as the answer.
        deadline = self.timeout_s + wait_s
        response = await self._call(
            "lease",
            lambda: self.stub.LeaseMicrobatches(request, timeout=deadline, metadata=self._metadata),
        )
        return lease_from_proto(response)

    async def report(self, trainer: str, result: MicrobatchResult) -> None:
        request = spb.SchedulerReportMicrobatchesRequest(
            job=self.job_id, trainer=trainer, results=[result_to_proto(result)]
        )
        await self._report(request)

    async def report_and_lease(
        self,
        trainer: str,
        results: Sequence[MicrobatchResult],
        count: int,
        *,
        working: Sequence[Working],
    ) -> Lease:
        request = spb.SchedulerReportMicrobatchesRequest(
            job=self.job_id,
            trainer=trainer,
            results=[result_to_proto(r) for r in results],
            next=lease_request(self.job_id, trainer, count, 0.0, working),
        )
        return lease_from_proto((await self._report(request)).lease)

    async def release(
        self, trainer: str, indices: Sequence[int], failure: str | None = None
    ) -> None:
        request = spb.SchedulerReportMicrobatchesRequest(
            job=self.job_id, trainer=trainer, released=indices, failure=failure or ""
        )
        await self._report(request)

    async def _report(
        self, request: spb.SchedulerReportMicrobatchesRequest
    ) -> spb.SchedulerReportMicrobatchesResponse:
        request.trainer_key = self.key
        return await self._call(
            "report",
            lambda: self.stub.ReportMicrobatches(
                request, timeout=self.timeout_s, metadata=self._metadata
            ),
        )


class _Progress:
    """Wraps a coordinator to move a progress bar as the job's step advances."""

    def __init__(self, inner: RemoteCoordinator, bar: tqdm) -> None:  # type: ignore[type-arg]
        self.inner, self.bar = inner, bar

    async def lease(
        self, trainer: str, count: int, *, wait_s: float = 0.0, working: Sequence[Working] = ()
    ) -> Lease:
        lease = await self.inner.lease(trainer, count, wait_s=wait_s, working=working)
        self.bar.update(max(0, lease.step - self.bar.n))
        return lease

    async def report(self, trainer: str, result: MicrobatchResult) -> None:
        await self.inner.report(trainer, result)

    async def report_and_lease(
        self,
        trainer: str,
        results: Sequence[MicrobatchResult],
        count: int,
        *,
        working: Sequence[Working],
    ) -> Lease:
        lease = await self.inner.report_and_lease(trainer, results, count, working=working)
        self.bar.update(max(0, lease.step - self.bar.n))
        return lease

    async def release(
        self, trainer: str, indices: Sequence[int], failure: str | None = None
    ) -> None:
        await self.inner.release(trainer, indices, failure)


async def run_remote_trainer(
    address: str,
    job_id: str,
    *,
    token: str | None = None,
    submitter_token: str | None = None,
    threads: int = 1,
    metrics_port: int | None = None,
    metrics_token: str | None = None,  # /metrics requires it (None: `token`)
    broker: str | None = None,
    retry_for_s: float = 600.0,
) -> int:
    """Train job `job_id` of the scheduler at `address` until it has no more steps. With
    `broker` (the swarm's MQTT broker URL), the wiring follows the replicas' load reports;
    with `submitter_token` (the job's submitter's), it is one of the job's own trainers
    (`RemoteCoordinator`). A scheduler that does not answer is asked again, backing off, for
    `retry_for_s`."""
    torch.set_num_threads(max(1, threads))
    remote = RemoteCoordinator(
        address, job_id, token=token, submitter_token=submitter_token, retry_for_s=retry_for_s
    )
    uses = Uses()  # the fetched data files this run reads: held until it ends
    try:
        status = await remote.job()
        # The data file at the path the job was submitted with, else fetched from the scheduler;
        # either way with the contents pinned then (the spec's data.sha256): else a ConfigError
        # names the file and both hashes, before any work is leased.
        job = parse_job(status.spec, Path(status.base_dir), name=status.name, check_data=False)
        job = await local_data(job, remote.fetch_data, cache_dir(), uses, job_id)
        # A trainer loads no weights (the stage servers do, and check the checkpoint against the
        # pin then): its starting checkpoint is checked here only when it is here, else the
        # pinned model.init_sha256 names it (a friend's trainer has no shared path).
        job = verify_init(job) if is_local(job) else job
        metrics = TrainerMetrics(job_id)
        if metrics_port is not None:
            serve_metrics(metrics.registry, "127.0.0.1", metrics_port, token=metrics_token or token)
        with tqdm(
            total=status.steps, initial=status.step, desc=f"trainer {job_id}", unit="step"
        ) as bar:
            trainer = PipelineTrainer(
                job, _Progress(remote, bar), job_id=job_id, token=token, metrics=metrics
            )
            try:
                async with load_followed(
                    broker, job_id, [trainer], token=token, registry=metrics.registry
                ):
                    await run_patiently(trainer, job.runtime.patience_s)
            finally:
                await trainer.close()
        print(
            f"{trainer.trainer_id}: trained {trainer.completed} microbatches of job {job_id}; "
            f"the job has no more steps",
            flush=True,
        )
    finally:
        uses.close()
        await remote.close()
    return 0


class Failing(Protocol):
    """What `run_patiently` needs of a trainer."""

    failure: str | None  # its last failure, None since its last microbatch went through
    failed_at: float  # when (`time.monotonic`) that failure came

    async def run(self) -> None: ...


# A trainer whose last failure is older than this is not failing: it waits for work (a job
# whose stage lost its replica hands out none). One cut off from a stage fails every few
# seconds: each microbatch goes back within `client.trainer`'s 2 s pause, and is leased again.
QUIET_S = 60.0


async def run_patiently(trainer: Failing, patience_s: float, quiet_s: float = QUIET_S) -> None:
    """`trainer.run()`, unless its microbatches keep failing, none going through, for
    `patience_s`: then it stops with `NoProgress`, naming its last failure. A remote trainer cut
    off from one stage (a firewall) retried for ever, its failures released to a scheduler
    whose other trainers went on, so the job's status never named them (a review found it).
    Waiting for work is no failure (no failure for `quiet_s`): a job stalled for its own reasons
    (a stage without a replica, a pause between attempts) is the scheduler's to say."""
    patience = Patience(
        patience_s, lambda: trainer.failure, waited="no microbatch of this trainer went through"
    )
    ran = asyncio.Event()

    async def not_failing() -> None:
        while True:
            if trainer.failure is None or time.monotonic() - trainer.failed_at > quiet_s:
                patience.committed()
            await asyncio.sleep(min(1.0, patience_s / 4))

    async def run() -> None:
        try:
            await trainer.run()
        finally:
            ran.set()

    # the run to its end, awaited whatever ends it (a `NoProgress` cancels it, then waits)
    await bounded(alongside(ran.wait(), [not_failing()], [run()]), patience)
