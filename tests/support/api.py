"""The job API (and health) on a real gRPC server over a real SQLite store, with `FakeControl`
standing in for the orchestration: shared by the job API, auth and client CLI tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from scheduler.admission import Admission
from scheduler.callers import Callers
from scheduler.job_api import JobApiServicer
from scheduler.store import JobStore
from swarm.errors import FailedPrecondition
from swarm.proto import control_pb2, scheduler_pb2, scheduler_pb2_grpc
from swarm.rpc.lease import ContributionAudit, Lease, MicrobatchResult, Task
from swarm.rpc.server_options import SCHEDULER_LIMITS, grpc_server

__all__ = ["AUDITED", "CHUNK", "FakeControl", "RunningApi", "api", "start_api"]

CHUNK = 1024  # bytes: small, so exports are chunked
# The contribution audit `FakeControl.lease` draws for step 0: stage 1's peer-b, with its seed
AUDITED = ContributionAudit(1, "peer-b", 0x5EED)


@dataclass
class FakeControl:
    """A `JobControl` that trains nothing: jobs named "run*" step to the end, "doomed*" fail."""

    store: JobStore
    submitted_ids: list[str] = field(default_factory=list)
    cancelled_ids: list[str] = field(default_factory=list)
    deleted_ids: list[str] = field(default_factory=list)
    broken: bool = False  # stages() raises: an orchestration bug
    routes_dir: Path = Path("/nonexistent")  # where `routes` says each job's record lies
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    reported: list[MicrobatchResult] = field(default_factory=list)  # what trainers reported
    state: dict[str, torch.Tensor] = field(
        default_factory=lambda: {
            "layers.0.weight": torch.randn(64, 32, dtype=torch.float64),  # 16 KiB: chunked
            "layers.0.bias": torch.arange(8, dtype=torch.float32),
            "layers.1.scale": torch.tensor(3.0, dtype=torch.bfloat16),
        }
    )

    def submitted(self, job_id: str) -> None:
        self.submitted_ids.append(job_id)
        if job_id.startswith(("run", "doomed")):
            task = asyncio.get_running_loop().create_task(self._train(job_id))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _train(self, job_id: str) -> None:
        self.store.set_state(job_id, "placing", message="placing")
        self.store.set_state(job_id, "running", message="training")
        self.store.record_event(job_id, "join", "peer-a joined stage 0")  # as the scheduler's
        record = self.store.get(job_id)
        assert record is not None
        for step in range(record.steps):
            await asyncio.sleep(0.02)
            if job_id.startswith("doomed"):
                self.store.set_state(job_id, "failed", error="stage 1 lost every replica")
                return
            self.store.record_step(job_id, step, 4.0 - step, 16, 0.02)
        self.store.set_state(job_id, "succeeded", message="done")
        self.store.record_event(job_id, "state", f"succeeded: {record.steps} steps")

    def cancelled(self, job_id: str) -> None:
        self.cancelled_ids.append(job_id)

    async def delete(self, job_id: str) -> None:
        self.deleted_ids.append(job_id)

    def stages(self, job_id: str) -> list[scheduler_pb2.StageStatus]:
        if self.broken:
            raise RuntimeError("orchestration bug")
        replica = scheduler_pb2.Replica(
            peer="peer-a",
            address="127.0.0.1:7000",
            device="cpu",
            state=control_pb2.PEER_STATE_SERVING,
            samples_per_second=99.5,
        )
        return [scheduler_pb2.StageStatus(stage=0, layers=[0, 1], replicas=[replica])]

    def samples_per_second(self, job_id: str) -> float:
        return 12.5

    def health(self, job_id: str) -> tuple[float, list[str]]:
        return 0.0, []

    def rounds(self, job_id: str, step: int) -> scheduler_pb2.RoundStatus | None:
        return None

    def routes(self, job_id: str) -> Path:
        return self.routes_dir / f"{job_id}.jsonl"

    async def lease(self, job_id: str, trainer: str, count: int, **_: object) -> Lease:
        """One task of step 0, with the step's contribution audit (`AUDITED`), as the
        coordinator leases it to its own trainer."""
        task = Task(0, len(self.reported), frozenset({0, 1}), audits=(AUDITED,))
        return Lease(0, [task], [])

    async def report(
        self, job_id: str, trainer: str, results: list[MicrobatchResult], *_: object
    ) -> None:
        self.reported += results

    async def export(self, job_id: str) -> tuple[int, dict[str, torch.Tensor]]:
        if job_id.startswith("empty"):
            raise FailedPrecondition("stage 2 has no replica and the job has no checkpoint")
        return 7, self.state


@dataclass
class RunningApi:
    server: grpc.aio.Server
    address: str
    store: JobStore
    control: FakeControl
    registry: CollectorRegistry

    async def stop(self) -> None:
        await self.server.stop(None)
        for task in list(self.control.tasks):
            task.cancel()
        self.store.close()


async def start_api(
    tmp_path: Path,
    *,
    token: str | None = None,
    more: Callable[[grpc.aio.Server], None] | None = None,
    address: str = "127.0.0.1:0",
    callers: Callers | None = None,
    admission: Admission | None = None,
    trusted_peers: bool = False,
) -> RunningApi:
    """The job API (and health) on a free port; `more` adds services before the start;
    `callers` and `admission`: who calls, what a job must fit (the servicer's defaults);
    `trusted_peers`: `swarm scheduler --trusted-peers`."""
    store = JobStore(tmp_path / "jobs.db")
    control = FakeControl(store)
    registry = CollectorRegistry()
    server = grpc_server(SCHEDULER_LIMITS, token=token, registry=registry)  # as the scheduler's
    servicer = JobApiServicer(
        store,
        control,
        chunk_bytes=CHUNK,
        data_root=tmp_path / "data",
        callers=callers,
        admission=admission,
        trusted_peers=trusted_peers,
    )
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if more is not None:
        more(server)
    port = server.add_insecure_port(address)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return RunningApi(server, f"127.0.0.1:{port}", store, control, registry)


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[RunningApi]:
    """The job API on a free port for one test (`start_api`'s defaults), stopped after it."""
    running = await start_api(tmp_path)
    yield running
    await running.stop()
