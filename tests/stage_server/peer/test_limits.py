"""A live stage server defends itself with limits of its own (issue 27, items 9 and 10): a
request is routed from its header before its body is allocated, the bodies it holds at once stay
within its receive budget, its concurrent calls within `max_concurrent_rpcs`, and a job's
`[runtime]` cannot raise any of its limits."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from stage_server.cli import add_arguments, peer_limits
from stage_server.peer.limits import PeerLimits
from stage_server.replica.messages import Limits
from stage_server.replica.runtime import StageRuntime
from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.device.sharing import FixedWindow
from swarm.errors import Busy, ConfigError
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.proto import framing, pool_pb2, pool_pb2_grpc, stage_pb2_grpc, tensor_pb2
from swarm.proto import stage_pb2 as pb
from swarm.rpc.status import from_rpc_error
from swarm.wire import codec
from swarm.wire.chunking import TENSOR_OVERHEAD_BYTES
from swarm.wire.crossing import Crossing
from tests.support.jobs import WIDE, make_job

MiB = 1 << 20
GiB = 1 << 30
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    """This process's resident memory (bytes), from /proc: the server runs in this process."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * _PAGE


async def _peak_rss_growth(
    call: Any, seconds: float, start: int | None = None
) -> tuple[int, BaseException | None]:
    """How far this process's RSS rose above `start` (default: now) while `call` (a stream)
    ran, sampled every 10 ms for at most `seconds`, and how the call ended (None: still
    running; then it is cancelled)."""
    start, peak = _rss() if start is None else start, 0

    async def drain() -> None:
        async for _ in call:
            pass

    task = asyncio.ensure_future(drain())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not task.done() and loop.time() < deadline:
        peak = max(peak, _rss() - start)
        await asyncio.sleep(0.01)
    peak = max(peak, _rss() - start)
    if not task.done():
        call.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return peak, None
    return peak, task.exception()


# `job` and `server` (conftest): `[runtime]` defaults, 1 GiB tensors.


async def _call(method: Any, *messages: Any) -> list[Any]:
    call = method(timeout=20)
    for m in messages:
        await call.write(m)
    await call.done_writing()
    return [r async for r in call]


def _reduce_header(job: str, nbytes: int, stage: int = 1, round: str = "r") -> Any:
    """A Reduce's first message declaring a part of `nbytes` bytes that never follow."""
    part = tensor_pb2.Tensor(name="part", dtype="float32", shape=[nbytes // 4], nbytes=nbytes)
    return pool_pb2.PoolReduceRequest(
        job=job, stage=stage, round=round, part=0, sender=0, group_size=2, tensors=[part]
    )


async def test_a_reduce_for_an_unknown_job_is_refused_before_its_declared_bytes_are_held(
    server: RunningStageServer,
) -> None:
    # A header declaring a 1 GiB part (within the job's max_tensor_bytes) for a job this replica
    # does not serve, its bytes never sent: refused from the header, nothing allocated for it.
    async with grpc.aio.insecure_channel(server.address) as channel:
        call = pool_pb2_grpc.PoolServiceStub(channel).Reduce(timeout=20)
        await call.write(_reduce_header("not-this-job", GiB))
        grown, ended = await _peak_rss_growth(call, 5.0)
    assert isinstance(ended, grpc.aio.AioRpcError), (
        f"not refused in 5 s; RSS grew {grown >> 20} MiB"
    )
    assert ended.code() == grpc.StatusCode.NOT_FOUND, ended
    assert grown < 256 * MiB, f"RSS grew {grown >> 20} MiB before the refusal"


async def test_a_full_replica_says_busy_from_a_pushs_header_before_its_body(
    tmp_path: Path,
) -> None:
    # The last stage with room for one queued microbatch, its worker held (one call running):
    # a Push is Busy from its header, though its declared inputs never arrive.
    job = make_job(tmp_path, training={"stages": 3}, runtime={"max_queue": 1})
    running = await start_stage_server(job, StageServerOptions(stage=2))
    release = threading.Event()
    held = asyncio.ensure_future(running.servicer.worker.run(release.wait, 30))
    try:
        while running.servicer.waiting < 1:
            await asyncio.sleep(0.01)
        inputs = tensor_pb2.Tensor(name="inputs", dtype="float64", shape=[4, 16, 32], nbytes=16384)
        header = pb.StagePushRequest(
            job=fingerprint(job),
            stage=2,
            microbatch=pb.MicrobatchId(step=0, index=0),
            tensors=[inputs, codec.encode(torch.zeros(4, 16, dtype=torch.int64), "targets")],
            accumulate=[2],
        )
        async with grpc.aio.insecure_channel(running.address) as channel:
            call = stage_pb2_grpc.StageServiceStub(channel).Push(timeout=20)
            await call.write(header)
            _, ended = await _peak_rss_growth(call, 5.0)
        assert isinstance(ended, grpc.aio.AioRpcError), "not answered in 5 s: waiting for the body"
        assert isinstance(from_rpc_error(ended), Busy), ended
    finally:
        release.set()
        await held
        await running.stop()


@pytest.fixture
def lavish(tmp_path: Path) -> JobConfig:
    """A job whose `[runtime]` would have its peers take anything: its limits are clamped."""
    return make_job(
        tmp_path,
        name="lavish",
        training={"stages": 3},
        runtime={"max_tensor_bytes": 10**15, "chunk_bytes": 1, "update_log_bytes": 10**15},
    )


async def test_a_tensor_above_the_peers_limit_is_refused_though_the_job_allows_it(
    lavish: JobConfig,
) -> None:
    running = await start_stage_server(lavish, StageServerOptions(stage=1))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            call = pool_pb2_grpc.PoolServiceStub(channel).Reduce(timeout=20)
            await call.write(_reduce_header(fingerprint(lavish), 2 * GiB))
            grown, ended = await _peak_rss_growth(call, 5.0)
        assert isinstance(ended, grpc.aio.AioRpcError), f"not refused; RSS grew {grown >> 20} MiB"
        assert ended.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ended
        assert "--max-tensor-bytes" in (ended.details() or ""), ended.details()
        assert grown < 256 * MiB, f"RSS grew {grown >> 20} MiB before the refusal"
    finally:
        await running.stop()


async def test_a_jobs_one_byte_chunks_are_raised_to_the_peers_floor(lavish: JobConfig) -> None:
    running = await start_stage_server(lavish, StageServerOptions(stage=1))
    try:
        x = codec.encode(torch.randn(1, 16, 32, dtype=torch.float64), "inputs")  # 4 KiB out
        request = pb.StageForwardRequest(
            job=fingerprint(lavish),
            stage=1,
            microbatch=pb.MicrobatchId(step=0, index=0),
            tensors=[x],
        )
        async with grpc.aio.insecure_channel(running.address) as channel:
            call = stage_pb2_grpc.StageServiceStub(channel).Forward(timeout=20)
            await call.write(request)
            await call.done_writing()
            replies = [m async for m in call]
        assert len(replies) == 1, f"a 4 KiB answer came in {len(replies)} messages"
        assert running.runtime.updates.max_bytes < lavish.runtime.update_log_bytes
    finally:
        await running.stop()


async def test_download_state_streams_from_the_snapshot_without_encoding_it_whole(
    tmp_path: Path,
) -> None:
    # Stage 0 of a wide vocabulary: its state is a 32 MiB embedding. A reader that takes the
    # first message and waits leaves the server holding its snapshot and a chunk or so, not a
    # second, encoded copy of the whole state; and a second download waits for no copy at all
    # when the peer serves one at a time.
    job = make_job(
        tmp_path,
        model=WIDE,
        runtime={"chunk_bytes": 256 << 10},
    )
    opts = StageServerOptions(stage=0, limits=PeerLimits(max_state_downloads=1))
    running = await start_stage_server(job, opts)
    try:
        size = sum(t.nbytes for t in running.runtime.export_state().values())
        assert size >= 32 * MiB
        request = pb.StageDownloadStateRequest(job=fingerprint(job), stage=0)
        # No BDP probing: the client's window stays small, so what this process holds for the
        # unread stream is the server's (the client shares the process).
        options = [("grpc.http2.bdp_probe", 0)]
        async with grpc.aio.insecure_channel(running.address, options=options) as channel:
            stub = stage_pb2_grpc.StageServiceStub(channel)
            start, grown = _rss(), 0
            call = stub.DownloadState(request, timeout=20)
            assert (await call.read()).step == 0
            for _ in range(50):  # half a second of the reader not reading
                grown = max(grown, _rss() - start)
                await asyncio.sleep(0.01)
            assert grown < size * 3 // 2, f"RSS grew {grown >> 20} MiB for {size >> 20} MiB"
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await anext(aiter(stub.DownloadState(request, timeout=20)))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-state-downloads" in (info.value.details() or "")
            call.cancel()
            for _ in range(500):  # the cancelled download lets go of its place
                if len(running.servicer._transfer.places) == 0:
                    break
                await asyncio.sleep(0.01)
            messages = [m async for m in stub.DownloadState(request, timeout=20)]
            declared = sum(t.nbytes for m in messages for t in m.tensors)
            sent = sum(len(m.chunk.data) + sum(len(t.data) for t in m.tensors) for m in messages)
            assert declared == sent == size
    finally:
        await running.stop()


async def test_bodies_past_the_receive_budget_are_refused_not_queued(job: JobConfig) -> None:
    # A 1 MiB budget: one Reduce sending a 1 MiB part, all but its last 4 KiB, holds nearly
    # all of it (a part holds its bytes as they come: issue 44, N6).
    limits = PeerLimits(max_tensor_bytes=MiB, receive_budget_bytes=MiB)
    running = await start_stage_server(job, StageServerOptions(stage=1, limits=limits))
    x = codec.encode(torch.randn(4, 16, 32, dtype=torch.float64), "inputs")
    forward = pb.StageForwardRequest(
        job=fingerprint(job), stage=1, microbatch=pb.MicrobatchId(step=0, index=0), tensors=[x]
    )
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            pool = pool_pb2_grpc.PoolServiceStub(channel)
            stage = stage_pb2_grpc.StageServiceStub(channel)
            holding = pool.Reduce(timeout=20)
            # (Each tensor is charged TENSOR_OVERHEAD_BYTES beyond its payload.)
            await holding.write(_reduce_header(fingerprint(job), MiB - TENSOR_OVERHEAD_BYTES))
            sent = MiB - TENSOR_OVERHEAD_BYTES - 4096
            await holding.write(framing.frame(pool_pb2.PoolReduceRequest, 0, bytes(sent)))
            while running.servicer.budget.in_use < sent:  # until the server holds it
                await asyncio.sleep(0.01)
            # Past the budget: the pool's call is refused, the data plane's is Busy.
            other = pool.Reduce(timeout=20)
            await other.write(_reduce_header(fingerprint(job), 4096, round="r2"))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await other.read()
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--receive-budget-bytes" in (info.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _call(stage.Forward, forward)
            assert isinstance(from_rpc_error(info.value), Busy), info.value
            holding.cancel()
            # The budget is given back with the call: the same Forward is served.
            for _ in range(500):
                if running.servicer.budget.in_use == 0:
                    break
                await asyncio.sleep(0.01)
            (reply,) = await _call(stage.Forward, forward)
            assert codec.decode(reply.tensors[0]).shape == (4, 16, 32)
            assert running.servicer.budget.in_use == 0
    finally:
        await running.stop()


async def test_calls_past_max_concurrent_rpcs_are_refused(job: JobConfig) -> None:
    limits = PeerLimits(max_concurrent_rpcs=2)
    running = await start_stage_server(job, StageServerOptions(stage=1, limits=limits))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = stage_pb2_grpc.StageServiceStub(channel)
            # Four calls that send nothing: each served one holds its place. At most two are
            # served, so at least two are refused (gRPC may refuse one early: it counts a call
            # until its task's end is seen).
            calls = [stub.Forward(timeout=20) for _ in range(4)]
            for _ in range(500):
                if sum(c.done() for c in calls) >= 2:
                    break
                await asyncio.sleep(0.01)
            done = [c for c in calls if c.done()]
            assert len(done) >= 2, "four calls served at once"
            for call in done:
                assert await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for call in calls:
                call.cancel()
            for _ in range(500):  # their places are given back
                try:
                    assert (await stub.Info(pb.StageInfoRequest(), timeout=20)).stage == 1
                    break
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                    await asyncio.sleep(0.01)
            else:
                raise AssertionError("no call served after the others ended")
    finally:
        await running.stop()


def test_a_jobs_runtime_is_clamped_by_the_peers_limits(
    lavish: JobConfig, job: JobConfig, caplog: pytest.LogCaptureFixture
) -> None:
    peer = PeerLimits(
        max_tensor_bytes=64 * MiB,
        min_chunk_bytes=1024,
        max_chunk_bytes=MiB,
        max_update_log_bytes=128 * MiB,
        receive_budget_bytes=256 * MiB,
    )
    limits = Limits(peer)
    assert (limits.chunk_bytes, limits.max_bytes) == (MiB, 64 * MiB)  # the defaults, clamped
    with caplog.at_level(logging.WARNING, logger="stage_server.replica.messages"):
        limits.serve(lavish)
        limits.serve(lavish)  # the same job again: logged once
    assert (limits.max_bytes, limits.chunk_bytes) == (64 * MiB, 1024)
    assert limits.update_log_bytes == 128 * MiB
    (record,) = caplog.records
    assert "max_tensor_bytes 1000000000000000 -> 67108864" in record.getMessage()
    assert "chunk_bytes 1 -> 1024" in record.getMessage()
    # The clients the replica makes (its next hop, a copy's source) take the same limits.
    runtime = limits.clamp(lavish).runtime
    assert (runtime.max_tensor_bytes, runtime.chunk_bytes) == (64 * MiB, 1024)
    assert runtime.update_log_bytes == 128 * MiB
    # The maxima are the smaller of the two; a job within the peer's limits keeps its own.
    limits.serve(job)
    assert (limits.max_bytes, limits.chunk_bytes) == (64 * MiB, MiB)  # 1 GiB and 4 MiB asked
    caplog.clear()
    modest = Limits(PeerLimits())
    modest.serve(job)
    assert (modest.max_bytes, modest.chunk_bytes) == (
        job.runtime.max_tensor_bytes,
        job.runtime.chunk_bytes,
    )
    assert modest.update_log_bytes == job.runtime.update_log_bytes and not caplog.records
    with pytest.raises(ConfigError, match="--min-chunk-bytes"):
        PeerLimits(min_chunk_bytes=2 * MiB, max_chunk_bytes=MiB)
    with pytest.raises(ConfigError, match=r"--receive-budget-bytes .* below --max-tensor-bytes"):
        PeerLimits(max_tensor_bytes=2 * GiB, receive_budget_bytes=GiB)
    with pytest.raises(ConfigError, match="--max-followers must be at least 1"):
        PeerLimits(max_followers=0)


def test_the_stage_servers_flags_set_its_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARM_MAX_FOLLOWERS", "2")
    parser = argparse.ArgumentParser()
    add_arguments("stage-server", parser)
    args = parser.parse_args(["--max-tensor-bytes", "1048576", "--receive-budget-bytes", "2097152"])
    assert peer_limits(args) == PeerLimits(
        max_tensor_bytes=MiB, receive_budget_bytes=2 * MiB, max_followers=2
    )
    assert peer_limits(parser.parse_args([])) == PeerLimits(max_followers=2)
    with pytest.raises(ConfigError, match="--max-chunk-bytes"):
        peer_limits(parser.parse_args(["--max-chunk-bytes", "1024"]))  # below the floor


def test_every_limit_a_job_names_is_clamped_by_the_peers(tmp_path: Path) -> None:
    # The review's job: a 2 GiB gRPC message from its next hop or copy source, a cache of a
    # billion microbatches' activations, a billion queued pushes. A peer's defaults take none.
    greedy = make_job(
        tmp_path,
        name="greedy",
        training={"stages": 3},
        runtime={"max_message_bytes": 2**31 - 1, "activation_cache": 10**9, "max_queue": 10**9},
    )
    limits = Limits(PeerLimits())
    limits.serve(greedy)
    runtime = limits.clamp(greedy).runtime
    shown = (runtime.max_message_bytes, runtime.activation_cache, runtime.max_queue)
    assert shown == (64 * MiB, 1024, 1024), shown
    assert (limits.max_message_bytes, limits.activation_cache, limits.max_queue) == shown
    # A peer's own: the message ceiling stays above its largest chunk and the chunk's header.
    peer = PeerLimits(
        max_chunk_bytes=MiB, max_message_bytes=2 * MiB, max_activation_cache=8, max_queue=16
    )
    limits = Limits(peer)
    limits.serve(greedy)
    runtime = limits.clamp(greedy).runtime
    assert (runtime.max_message_bytes, runtime.activation_cache, runtime.max_queue) == (
        2 * MiB,
        8,
        16,
    )
    assert runtime.chunk_bytes == MiB < runtime.max_message_bytes
    with pytest.raises(ConfigError, match=r"--max-message-bytes .* --max-chunk-bytes"):
        PeerLimits(max_chunk_bytes=16 * MiB, max_message_bytes=16 * MiB)
    # The job's defaults and smaller values are its own: nothing clamped, nothing logged.
    job = make_job(tmp_path, name="plain", runtime={"activation_cache": 2, "max_queue": 3})
    limits = Limits(PeerLimits())
    limits.serve(job)
    runtime = limits.clamp(job).runtime
    assert (runtime.max_message_bytes, runtime.activation_cache, runtime.max_queue) == (
        job.runtime.max_message_bytes,
        2,
        3,
    )
    parser = argparse.ArgumentParser()
    add_arguments("stage-server", parser)
    flags = ["--max-activation-cache", "5", "--max-queue", "6", "--max-message-bytes", "33554432"]
    assert peer_limits(parser.parse_args(flags)) == PeerLimits(
        max_activation_cache=5, max_queue=6, max_message_bytes=32 * MiB
    )


async def test_a_jobs_activation_cache_is_clamped_on_a_live_replica(tmp_path: Path) -> None:
    # A job asking a billion cached microbatches, a trainer sending Forwards of distinct
    # microbatches and never their Backwards: the replica keeps at most the peer's cap, with
    # their graphs; the others' Backwards recompute from their inputs.
    job = make_job(tmp_path, training={"stages": 3}, runtime={"activation_cache": 10**9})
    opts = StageServerOptions(stage=1, limits=PeerLimits(max_activation_cache=4))
    running = await start_stage_server(job, opts)
    try:
        x = codec.encode(torch.randn(1, 16, 32, dtype=torch.float64), "inputs")
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = stage_pb2_grpc.StageServiceStub(channel)
            for index in range(12):
                request = pb.StageForwardRequest(
                    job=fingerprint(job),
                    stage=1,
                    microbatch=pb.MicrobatchId(step=0, index=index),
                    tensors=[x],
                )
                (reply,) = await _call(stub.Forward, request)
                assert codec.decode(reply.tensors[0]).shape == (1, 16, 32)
        cached = len(running.runtime._cache)
        assert cached == 4, f"{cached} microbatches cached for 12 Forwards"
    finally:
        await running.stop()


async def test_the_servers_grpc_messages_stay_within_the_peers_ceiling(tmp_path: Path) -> None:
    # A job allowing 2 GiB messages: a single 3 MiB message is refused by gRPC itself, before
    # the servicer sees it, when the peer's ceiling is 2 MiB.
    job = make_job(tmp_path, training={"stages": 3}, runtime={"max_message_bytes": 2**31 - 1})
    peer = PeerLimits(max_chunk_bytes=MiB, max_message_bytes=2 * MiB)
    running = await start_stage_server(job, StageServerOptions(stage=1, limits=peer))
    try:
        big = codec.encode(torch.randn(3 * MiB // 8, dtype=torch.float64), "inputs")
        request = pb.StageForwardRequest(
            job=fingerprint(job),
            stage=1,
            microbatch=pb.MicrobatchId(step=0, index=0),
            tensors=[big],
        )
        options = [("grpc.max_send_message_length", 64 * MiB)]
        async with grpc.aio.insecure_channel(running.address, options=options) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _call(stage_pb2_grpc.StageServiceStub(channel).Forward, request)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
        assert "larger than max" in (info.value.details() or ""), info.value.details()
    finally:
        await running.stop()


def _half_second_job(tmp_path: Path) -> JobConfig:
    """A job of three stages whose calls and rounds each wait 0.5 s for what they are sent."""
    runtime = {"rpc_timeout_s": 0.5, "averaging_timeout_s": 0.5}
    return make_job(tmp_path, training={"stages": 3}, runtime=runtime)


def _opened(channel: grpc.aio.Channel, method: str) -> tuple[Any, str]:
    """A `method` call ("Reduce" or "Forward") opened with no deadline of its own, nothing
    written; the job's setting that bounds it."""
    if method == "Reduce":
        return pool_pb2_grpc.PoolServiceStub(channel).Reduce(), "averaging_timeout_s"
    return stage_pb2_grpc.StageServiceStub(channel).Forward(), "rpc_timeout_s"


@pytest.mark.parametrize("method", ["Reduce", "Forward"])
async def test_a_body_that_never_comes_gives_its_reservation_back(
    tmp_path: Path, method: str
) -> None:
    # The review's repro (issue 27): a caller with no deadline of its own declares a body and
    # never sends it. The server ends the call once the job's timeout (rpc_timeout_s for the
    # data plane, averaging_timeout_s for Reduce) passes from the header: DEADLINE_EXCEEDED
    # naming it, and the bytes the header reserved given back.
    job = _half_second_job(tmp_path)
    running = await start_stage_server(job, StageServerOptions(stage=1))
    budget = running.servicer.budget
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            call, setting = _opened(channel, method)
            if method == "Reduce":
                await call.write(_reduce_header(fingerprint(job), MiB))
            else:
                inputs = tensor_pb2.Tensor(
                    name="inputs", dtype="float64", shape=[4, 16, 32], nbytes=16384
                )
                await call.write(
                    pb.StageForwardRequest(
                        job=fingerprint(job),
                        stage=1,
                        microbatch=pb.MicrobatchId(step=0, index=0),
                        tensors=[inputs],
                    )
                )
            for _ in range(200):  # until the server holds the header's bytes
                if budget.in_use > 0:
                    break
                await asyncio.sleep(0.01)
            assert budget.in_use > 0
            for _ in range(250):  # 2.5 s at most, five times the deadline
                if call.done() and budget.in_use == 0:
                    break
                await asyncio.sleep(0.01)
            held, done = budget.in_use, call.done()
            call.cancel()  # (before the fix: the call still waits, holding its bytes)
        assert held == 0, f"{held} bytes still reserved 2.5 s after a 0.5 s body deadline"
        assert done and await call.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert f"runtime.{setting}" in (await call.details() or ""), await call.details()
    finally:
        await running.stop()


@pytest.mark.parametrize("method", ["Reduce", "Forward"])
async def test_a_call_whose_header_never_comes_ends_at_the_jobs_timeout(
    tmp_path: Path, method: str
) -> None:
    # A review's repro: a caller with no deadline of its own opens a call and writes nothing.
    # The body's deadline ran from the header only, so the call held one of the server's
    # `max_concurrent_rpcs` for as long as its connection lived (4 h by default): 1024 such
    # calls refused every other call, the scheduler's Commit and Join too. The header is
    # bounded by the job's timeout as the body is: DEADLINE_EXCEEDED, naming it.
    job = _half_second_job(tmp_path)
    running = await start_stage_server(job, StageServerOptions(stage=1))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            call, setting = _opened(channel, method)
            for _ in range(250):  # 2.5 s at most, five times the deadline
                if call.done():
                    break
                await asyncio.sleep(0.01)
            done = call.done()
            call.cancel()  # (before the fix: the call still waits for its header)
        assert done, "the call still open 2.5 s after a 0.5 s deadline"
        assert await call.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        details = await call.details() or ""
        assert "header" in details and f"runtime.{setting}" in details, details
    finally:
        await running.stop()


async def test_the_activation_cache_is_bounded_by_bytes_on_a_live_replica(tmp_path: Path) -> None:
    # Issue 41: the cache was bounded by count only (64 by default): 64 microbatches' graphs of
    # a large stage fill a GPU. The peer's --max-activation-cache-bytes bounds their bytes too,
    # evicting the oldest as the count bound does (its Backward then needs its inputs).
    job = make_job(tmp_path, training={"stages": 3})  # activation_cache 64
    bound = 256 * 1024
    opts = StageServerOptions(stage=1, limits=PeerLimits(max_activation_cache_bytes=bound))
    running = await start_stage_server(job, opts)
    try:
        x = codec.encode(torch.randn(1, 16, 32, dtype=torch.float64), "inputs")
        g = codec.encode(torch.ones(1, 16, 32, dtype=torch.float64), "grad_outputs")
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = stage_pb2_grpc.StageServiceStub(channel)

            def mb(index: int) -> Any:
                return {
                    "job": fingerprint(job),
                    "stage": 1,
                    "microbatch": pb.MicrobatchId(step=0, index=index),
                }

            for index in range(12):
                (reply,) = await _call(
                    stub.Forward, pb.StageForwardRequest(**mb(index), tensors=[x])
                )
                assert codec.decode(reply.tensors[0]).shape == (1, 16, 32)
            cache = running.runtime._cache
            assert len(cache) < 12, f"{len(cache)} microbatches cached within {bound} bytes"
            assert len(cache) >= 1 and cache.bytes <= bound, (len(cache), cache.bytes)
            # The newest is kept: its Backward needs no inputs; the oldest's does.
            backward = pb.StageBackwardRequest(
                **mb(11), tensors=[g], accumulate=False, need_grad_inputs=True
            )
            (reply,) = await _call(stub.Backward, backward)
            assert codec.decode(reply.tensors[0]).shape == (1, 16, 32)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _call(stub.Backward, pb.StageBackwardRequest(**mb(0), tensors=[g]))
            assert "send its inputs" in str(refused.value.details())
    finally:
        await running.stop()


def test_a_microbatch_above_the_whole_byte_bound_is_not_kept_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # One microbatch's activations above the peer's whole bound: none kept (its Backward
    # recomputes from its inputs), and the operator is told which flag to raise.
    job = make_job(tmp_path, training={"stages": 3})
    runtime = StageRuntime(job, 1)
    runtime.window = FixedWindow(1024, sized=True)
    with caplog.at_level(logging.WARNING, logger="stage_server.replica.activation_cache"):
        runtime.forward(0, 0, Crossing(torch.randn(1, 16, 32, dtype=torch.float64)))
    assert len(runtime._cache) == 0
    (record,) = caplog.records
    assert "--max-activation-cache-bytes 1024" in record.getMessage()
