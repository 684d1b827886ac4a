"""A step's commit ends: an aborted averaging round names the members it failed on, all the way
from the owner of a part to the coordinator (`swarm-missing` in the trailing metadata), the
coordinator leaves the culprit out and commits with the rest, and rounds that keep failing fail
the job after `runtime.max_commit_rounds`. Also: the pool's owner side (`PoolService`) follows the
served job's `[runtime]`, however the stage was installed."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from stage_server.averaging.butterfly import RoundSettings, all_reduce
from stage_server.averaging.owner import AveragingAborted
from stage_server.replica.runtime import StageRuntime
from stage_server.server import (
    RunningStageServer,
    StageServerOptions,
    start_grpc,
    start_stage_server,
)
from swarm.errors import Aborted, SwarmError
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.proto import pool_pb2, pool_pb2_grpc
from swarm.proto import stage_pb2 as pb
from swarm.rpc.lease import Task
from swarm.rpc.stage_client import StageClient
from swarm.rpc.status import ERROR_KEY, MISSING_KEY, error_metadata, from_rpc_error
from swarm.wire import chunking as wire
from swarm.wire.codec import encode
from tests.support.coordinator import MakeHarness, job_of
from tests.support.jobs import make_job
from tests.support.pools import JOB, replicas
from tests.support.ports import free_address
from tests.support.replicas import FakeSwarm, Prepared

pytestmark = pytest.mark.timeout(60)


# --- the coordinator, against in-memory replicas ---------------------------------------------


async def test_two_replicas_that_cannot_reach_each_other_keep_one_and_the_step_commits(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, b, c = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    a.cannot_reach(b)
    b.cannot_reach(a)  # every round of both aborts, each naming the other
    said: list[str] = []
    h = make_harness(job, swarm, on_status=said.append)
    await h.coordinator.start()
    first, second = await h.lease()
    await h.run(first, {0: "a"})
    await h.run(second, {0: "b"})
    # One side is kept (a: equal holdings, first in the group), the other left out: its
    # microbatch is replayed on the survivor, at its stage only.
    replay = await h.lease()
    assert replay == [Task(0, 1, frozenset({0}))]
    assert [r.peer for r in h.coordinator.replicas()[0]] == ["a"]
    assert b.called("discard") == [0]
    await h.run(replay[0], {0: "a"})
    assert (await asyncio.wait_for(h.steps.get(), 5)).step == 0
    assert a.called("prepare")[-1] == Prepared(0, [0, 1], 8, ["fake:a"], 0, "0/1")
    assert len(b.called("prepare")) == 1 and b.called("apply") == [] and (a.step, c.step) == (1, 1)
    assert b.called("join") == ["fake:a"]  # back at the boundary, as a copy of the survivor
    assert any("stage 0" in s and "b" in s and "could not average" in s for s in said), said


async def test_the_replica_the_others_cannot_reach_is_left_out(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path, target_batch_size=12)  # three microbatches
    swarm = FakeSwarm(fingerprint(job), 2)
    a, b, x = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(0, "x")
    swarm.add(1, "c")
    x.cannot_reach(a, b)
    a.cannot_reach(x)
    b.cannot_reach(x)
    h = make_harness(job, swarm)
    await h.coordinator.start()
    tasks = await h.lease()
    for task, peer in zip(tasks, "xab", strict=True):
        await h.run(task, {0: peer})
    replay = await h.lease()
    assert replay == [Task(0, 0, frozenset({0}))]  # x's, replayed
    assert [r.peer for r in h.coordinator.replicas()[0]] == ["a", "b"]
    await h.run(replay[0], {0: "b"})
    assert (await asyncio.wait_for(h.steps.get(), 5)).step == 0
    assert a.called("prepare")[-1].group == ["fake:a", "fake:b"]
    assert x.called("discard") == [0] and not a.called("discard") and not b.called("discard")


async def test_rounds_that_keep_failing_without_a_culprit_fail_the_job_after_the_bound(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = make_job(
        tmp_path,
        training={"stages": 2, "microbatch_size": 4, "target_batch_size": 8, "steps": 3},
        runtime={"max_commit_rounds": 3},
    )
    swarm = FakeSwarm(fingerprint(job), 2)
    a, b, c = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    b.fail("prepare", *(Aborted("a member did not send its part") for _ in range(50)))
    h = make_harness(job, swarm)
    await h.coordinator.start()
    first, second = await h.lease()
    await h.run(first, {0: "a"})
    await h.run(second, {0: "b"})
    await asyncio.wait_for(h.coordinator.finished.wait(), 10)
    error = h.coordinator.error
    assert isinstance(error, SwarmError), error
    assert "step 0" in str(error) and "3 averaging rounds failed" in str(error)
    assert "a member did not send its part" in str(error)  # the last round's reason
    assert [p.round for p in b.called("prepare")] == ["0/0", "0/1", "0/2"]
    with pytest.raises(SwarmError, match="averaging rounds failed"):
        await h.coordinator.lease("t", 1)
    assert h.steps.empty() and (a.step, b.step, c.step) == (0, 0, 0)


# --- the culprit travels over the wire -------------------------------------------------------


@pytest.fixture
def small_job(tmp_path: Path) -> JobConfig:
    return make_job(
        tmp_path,
        training={"stages": 2},
        runtime={"max_tensor_bytes": 1024, "averaging_timeout_s": 0.5},
    )


async def test_a_prepare_that_cannot_reach_its_pool_names_the_member_in_its_abort(
    small_job: JobConfig,
) -> None:
    running = await start_stage_server(small_job, StageServerOptions(stage=0))
    client = StageClient(running.address, small_job, fingerprint(small_job), 0)
    try:
        with pytest.raises(Aborted) as info:
            await client.commit(
                0,
                [],
                8,
                phase=pb.COMMIT_PHASE_PREPARE,
                group=[running.address, free_address()],
                group_index=0,
                round="0/0",
            )
        assert info.value.missing == (1,)
    finally:
        await client.close()
        await running.stop()


@pytest.mark.parametrize("fault", ["closed port", "silent"])
async def test_every_live_replica_names_the_one_that_failed_the_round(fault: str) -> None:
    async with replicas(4, timeout_s=1.0) as pool:  # the job's: its members' calls' and owners
        culprit = 2
        if fault == "closed port":
            await pool[culprit].server.stop(None)
        group = [r.address for r in pool]
        calls = [
            all_reduce(
                torch.randn(999),
                RoundSettings(
                    group=group,
                    index=i,
                    round="r0",
                    job=JOB,
                    stage=0,
                    timeout_s=1.0,
                    chunk_bytes=1 << 20,
                    max_bytes=1 << 26,
                ),
                averager=r.averager,
                channels=r.channels,
            )
            for i, r in enumerate(pool)
            if i != culprit  # silent: its PoolService answers, but it sends no part
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, AveragingAborted) for r in results), results
        assert [r.missing for r in results] == [(culprit,)] * 3, results


class _RpcError(grpc.RpcError):
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.ABORTED

    def details(self) -> str:
        return "round aborted"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


def test_missing_members_cross_the_wire_in_the_trailing_metadata() -> None:
    metadata = error_metadata(AveragingAborted("aborted", (3, 1)))
    assert (MISSING_KEY, "3,1") in metadata
    error = from_rpc_error(_RpcError(metadata))
    assert type(error) is Aborted and error.missing == (3, 1)
    assert error_metadata(Aborted("no one named")) == ((ERROR_KEY, "Aborted"),)
    for bad in ("x", "1,,2", "-1", "1;2", "\u00b2", "1" * 7, ""):  # a peer's nonsense: no one
        error = from_rpc_error(_RpcError(((MISSING_KEY, bad),)))
        assert isinstance(error, Aborted) and error.missing == (), bad


# --- the owner side follows the served job ---------------------------------------------------


async def _installed(job: JobConfig, how: str) -> tuple[RunningStageServer, str]:
    """A stage server serving stage 0 of `job`: given on the command line, or built with the
    defaults and then assigned the stage (as `stage_server.agent` does under a scheduler)."""
    if how == "command line":
        return await start_stage_server(job, StageServerOptions(stage=0)), fingerprint(job)
    running = await start_grpc(StageServerOptions(stage=0), 64 << 20)
    running.servicer.serve(StageRuntime(job, 0, torch.device("cpu")), "job-x")
    return running, "job-x"


async def _reduce(address: str, job_id: str, values: torch.Tensor, group_size: int) -> Any:
    async with grpc.aio.insecure_channel(address) as channel:
        call: Any = pool_pb2_grpc.PoolServiceStub(channel).Reduce()  # no deadline of its own
        request = pool_pb2.PoolReduceRequest(
            job=job_id,
            stage=0,
            round="r",
            part=0,
            sender=0,
            group_size=group_size,
            tensors=[encode(values, "part")],
        )
        for m in wire.split(request, 1 << 20):
            await call.write(m)
        await call.done_writing()
        try:
            return await wire.receive(call.__aiter__(), max_bytes=1 << 20)
        except grpc.aio.AioRpcError as e:
            return e


@pytest.mark.parametrize("how", ["command line", "assigned"])
async def test_the_pool_service_takes_the_served_jobs_limits_and_timeout(
    small_job: JobConfig, how: str
) -> None:
    running, job_id = await _installed(small_job, how)
    try:
        # A part over the job's max_tensor_bytes (1 KiB) is refused before it is allocated.
        over = await _reduce(running.address, job_id, torch.ones(512), 1)
        assert isinstance(over, grpc.aio.AioRpcError), over
        assert over.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # A round whose other sender never comes aborts after the job's averaging_timeout_s
        # (0.5 s), naming the sender it waited for.
        start = time.monotonic()
        waited = await asyncio.wait_for(_reduce(running.address, job_id, torch.ones(16), 2), 5)
        assert time.monotonic() - start < 2.0
        assert isinstance(waited, grpc.aio.AioRpcError), waited
        error = from_rpc_error(waited)
        assert isinstance(error, Aborted) and error.missing == (1,)
    finally:
        await running.stop()
