"""A trainer outside the scheduler: `swarm trainer --scheduler ADDR --job ID`. It leases the
job's microbatches over the job API (`RemoteCoordinator`) and trains them like the embedded one;
several may train one job together, and a trainer that disappears has its leases re-issued."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm import tqdm

from client.coordinator import Lease, MicrobatchResult, lease_from_proto, result_to_proto
from client.trainer import PipelineTrainer
from swarm import auth
from swarm.config import parse_job
from swarm.metrics import TrainerMetrics, serve_metrics
from swarm.proto import scheduler_pb2 as spb
from swarm.proto import scheduler_pb2_grpc
from swarm.wire import grpc_options

__all__ = ["RemoteCoordinator", "run_remote_trainer"]

log = logging.getLogger(__name__)


class RemoteCoordinator:
    """The scheduler's step coordinator, over gRPC."""

    def __init__(
        self, address: str, job_id: str, *, token: str | None = None, timeout_s: float = 30.0
    ) -> None:
        self.job_id, self.timeout_s = job_id, timeout_s
        self.channel = auth.channel(address, token=token, options=grpc_options(64 << 20))
        self.stub = scheduler_pb2_grpc.SchedulerServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def job(self) -> spb.JobStatus:
        response = await self.stub.GetJob(
            spb.SchedulerGetJobRequest(job=self.job_id), timeout=self.timeout_s
        )
        return response.job

    async def lease(self, trainer: str, count: int) -> Lease:
        request = spb.SchedulerLeaseMicrobatchesRequest(
            job=self.job_id, trainer=trainer, count=count
        )
        return lease_from_proto(await self.stub.LeaseMicrobatches(request, timeout=self.timeout_s))

    async def report(self, trainer: str, result: MicrobatchResult) -> None:
        request = spb.SchedulerReportMicrobatchesRequest(
            job=self.job_id, trainer=trainer, results=[result_to_proto(result)]
        )
        await self.stub.ReportMicrobatches(request, timeout=self.timeout_s)

    async def release(self, trainer: str, indices: list[int]) -> None:
        request = spb.SchedulerReportMicrobatchesRequest(
            job=self.job_id, trainer=trainer, released=indices
        )
        await self.stub.ReportMicrobatches(request, timeout=self.timeout_s)


class _Progress:
    """Wraps a coordinator to move a progress bar as the job's step advances."""

    def __init__(self, inner: RemoteCoordinator, bar: tqdm) -> None:  # type: ignore[type-arg]
        self.inner, self.bar = inner, bar

    async def lease(self, trainer: str, count: int) -> Lease:
        lease = await self.inner.lease(trainer, count)
        self.bar.update(max(0, lease.step - self.bar.n))
        return lease

    async def report(self, trainer: str, result: MicrobatchResult) -> None:
        await self.inner.report(trainer, result)

    async def release(self, trainer: str, indices: list[int]) -> None:
        await self.inner.release(trainer, indices)


async def run_remote_trainer(
    address: str,
    job_id: str,
    *,
    token: str | None = None,
    threads: int = 1,
    metrics_port: int | None = None,
) -> int:
    torch.set_num_threads(max(1, threads))
    remote = RemoteCoordinator(address, job_id, token=token)
    try:
        status = await remote.job()
        # The data file must be at the same path here as where the job was submitted.
        job = parse_job(status.spec, Path(status.base_dir), name=status.name)
        metrics = TrainerMetrics(job_id)
        if metrics_port is not None:
            serve_metrics(metrics.registry, "127.0.0.1", metrics_port)
        with tqdm(
            total=status.steps, initial=status.step, desc=f"trainer {job_id}", unit="step"
        ) as bar:
            trainer = PipelineTrainer(
                job, _Progress(remote, bar), job_id=job_id, token=token, metrics=metrics
            )
            try:
                await trainer.run()
            finally:
                await trainer.close()
        print(
            f"{trainer.trainer_id}: trained {trainer.completed} microbatches of job {job_id}; "
            f"the job has no more steps",
            flush=True,
        )
    finally:
        await remote.close()
    return 0
