"""The job API on a real gRPC server (port 0) over a real SQLite store, through `SchedulerClient`.
The orchestration is not under test: `FakeControl` stands in for it (and is reused by the auth
and CLI tests)."""

from __future__ import annotations

import asyncio
import math
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from client.remote import RemoteCoordinator
from client.sdk import ClientError, SchedulerClient
from scheduler.job_api import JobApiServicer
from scheduler.store import JobStore
from swarm.auth import server_interceptors
from swarm.errors import ConfigError, FailedPrecondition
from swarm.proto import control_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.jobs import BASE, render, write_job

CHUNK = 1024  # bytes: small, so exports are chunked


@dataclass
class FakeControl:
    """A `JobControl` that trains nothing: jobs named "run*" step to the end, "doomed*" fail."""

    store: JobStore
    submitted_ids: list[str] = field(default_factory=list)
    cancelled_ids: list[str] = field(default_factory=list)
    broken: bool = False  # stages() raises: an orchestration bug
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
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
        record = self.store.get(job_id)
        assert record is not None
        for step in range(record.steps):
            await asyncio.sleep(0.02)
            if job_id.startswith("doomed"):
                self.store.set_state(job_id, "failed", error="stage 1 lost every replica")
                return
            self.store.record_step(job_id, step, 4.0 - step, 16, 0.02)
        self.store.set_state(job_id, "succeeded", message="done")

    def cancelled(self, job_id: str) -> None:
        self.cancelled_ids.append(job_id)

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
) -> RunningApi:
    """The job API (and health) on a free port; `more` adds services before the start."""
    store = JobStore(tmp_path / "jobs.db")
    control = FakeControl(store)
    registry = CollectorRegistry()
    server = grpc.aio.server(interceptors=server_interceptors(token, registry))
    servicer = JobApiServicer(store, control, chunk_bytes=CHUNK)
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
def free_address() -> str:
    """An address nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[RunningApi]:
    running = await start_api(tmp_path)
    yield running
    await running.stop()


@pytest.fixture
async def client(api: RunningApi) -> AsyncIterator[SchedulerClient]:
    async with SchedulerClient(api.address, timeout_s=5.0) as c:
        yield c


async def test_submit_get_list(api: RunningApi, client: SchedulerClient, tmp_path: Path) -> None:
    first = await client.submit(write_job(tmp_path, "first"))
    assert first.job.startswith("first-") and first.name == "first"
    assert first.state == control_pb2.JOB_STATE_QUEUED
    assert (first.step, first.steps, first.samples_per_second) == (0, 3, 12.5)
    assert math.isnan(first.loss) and first.created > 0
    assert first.stages[0].replicas[0].peer == "peer-a"
    assert api.control.submitted_ids == [first.job]
    # No `name` key: the job is named after its file, as `swarm local` would name it.
    nameless = tmp_path / "nameless.toml"
    nameless.write_text(render(BASE).split("\n", 1)[1])
    second = await client.submit(nameless)
    assert second.name == "nameless"
    stored = api.store.get(second.job)
    assert stored is not None and stored.base_dir == str(tmp_path.resolve())
    got = await client.get(first.job)
    assert got.job == first.job and got.state == control_pb2.JOB_STATE_QUEUED
    assert [j.job for j in await client.list()] == [second.job, first.job]


async def test_server_validates_the_spec(api: RunningApi) -> None:
    async with grpc.aio.insecure_channel(api.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        bad = render({**BASE, "training": {**BASE["training"], "dtype": "float16"}})
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.SubmitJob(scheduler_pb2.SchedulerSubmitJobRequest(spec=bad, base_dir="/"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "training.dtype" in (e.value.details() or "")
        good = render(BASE)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.SubmitJob(scheduler_pb2.SchedulerSubmitJobRequest(spec=good, base_dir="x"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "absolute" in (e.value.details() or "")
    assert api.store.list() == [] and api.control.submitted_ids == []


async def test_bad_job_file_fails_before_the_network(tmp_path: Path, free_address: str) -> None:
    path = write_job(tmp_path, training={"dtype": "float16"})
    async with SchedulerClient(free_address) as c:
        with pytest.raises(ConfigError, match=r"training\.dtype"):
            await c.submit(path)


async def test_unknown_job(client: SchedulerClient) -> None:
    for call in (client.get, client.cancel):
        with pytest.raises(ClientError, match="unknown job 'nope'; `swarm jobs` lists them") as e:
            await call("nope")
        assert e.value.code == "NOT_FOUND"


async def test_cancel(api: RunningApi, client: SchedulerClient, tmp_path: Path) -> None:
    job = (await client.submit(write_job(tmp_path, "idle"))).job
    cancelled = await client.cancel(job)
    assert cancelled.state == control_pb2.JOB_STATE_CANCELLED and cancelled.stages == []
    assert api.control.cancelled_ids == [job]
    with pytest.raises(ClientError, match="already cancelled") as e:
        await client.cancel(job)
    assert e.value.code == "FAILED_PRECONDITION"


async def test_wait_until_the_end(client: SchedulerClient, tmp_path: Path) -> None:
    job = (await client.submit(write_job(tmp_path, "run"))).job
    seen: list[int] = []
    final = await client.wait(job, lambda s: seen.append(s.step), poll_s=0.01)
    assert final.state == control_pb2.JOB_STATE_SUCCEEDED
    assert (final.step, final.loss, final.samples_per_second) == (3, 2.0, 0.0)
    assert seen == sorted(seen) and seen[-1] == 3


async def test_export(api: RunningApi, client: SchedulerClient, tmp_path: Path) -> None:
    job = (await client.submit(write_job(tmp_path, "exp"))).job
    out = tmp_path / "model.pt"
    assert await client.export(job, out) == 7
    loaded = torch.load(out, weights_only=True)
    assert loaded.keys() == api.control.state.keys()
    for name, tensor in api.control.state.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


async def test_export_refused(client: SchedulerClient, tmp_path: Path) -> None:
    job = (await client.submit(write_job(tmp_path, "empty"))).job
    with pytest.raises(ClientError, match="no checkpoint") as e:
        await client.export(job, tmp_path / "model.pt")
    assert e.value.code == "FAILED_PRECONDITION" and not (tmp_path / "model.pt").exists()
    with pytest.raises(ClientError, match="unknown job") as e:
        await client.export("nope", tmp_path / "model.pt")


async def test_internal_error_keeps_serving(
    api: RunningApi, client: SchedulerClient, tmp_path: Path
) -> None:
    job = (await client.submit(write_job(tmp_path, "ok"))).job
    api.control.broken = True
    with pytest.raises(ClientError, match="RuntimeError: orchestration bug") as e:
        await client.get(job)
    assert e.value.code == "INTERNAL"
    api.control.broken = False
    assert (await client.get(job)).job == job


async def test_a_remote_trainer_rides_out_a_scheduler_that_is_not_up_yet(
    tmp_path: Path, free_address: str
) -> None:
    with JobStore(tmp_path / "jobs.db") as store:
        job_id = store.create("test", render(BASE), str(tmp_path), 3).id
    remote = RemoteCoordinator(free_address, job_id, timeout_s=2.0, retry_for_s=30.0)
    try:
        asked = asyncio.create_task(remote.job())
        await asyncio.sleep(1.0)  # UNAVAILABLE meanwhile: it keeps asking
        assert not asked.done()
        running = await start_api(tmp_path, address=free_address)
        try:
            assert (await asyncio.wait_for(asked, 20)).job == job_id
            # A final answer is not asked again.
            unknown = RemoteCoordinator(free_address, "nope", retry_for_s=30.0)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await unknown.job()
            await unknown.close()
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        finally:
            await running.stop()
    finally:
        await remote.close()
