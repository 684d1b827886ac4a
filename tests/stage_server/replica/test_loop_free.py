"""The event loop never waits on the device (issue 41, item 3): a live stage server (real gRPC on
a free port, in this process) whose device is slow to copy a Forward's outputs to the host
(`tests.support.slow_copies`, behind `swarm.device.host_copies.HostCopies`) still answers
other calls, and its loop wakes on time, while that copy is under way."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc
from swarm.wire import codec
from tests.support.fake_device import copy_started
from tests.support.jobs import make_job
from tests.support.slow_copies import SlowCopies

pytestmark = pytest.mark.timeout(120)


def _forward(job: JobConfig, step: int = 0) -> pb.StageForwardRequest:
    hidden = torch.randn(4, 16, 32, dtype=torch.float64)
    return pb.StageForwardRequest(
        job=fingerprint(job),
        stage=1,
        microbatch=pb.MicrobatchId(step=step, index=0),
        tensors=[codec.encode(hidden, "inputs")],
    )


async def _call(method: Any, request: Any) -> list[Any]:
    call = method(timeout=60)
    await call.write(request)
    await call.done_writing()
    return [r async for r in call]


async def test_the_loop_answers_another_call_while_a_reply_is_copied_off_the_device(
    job: JobConfig, server: RunningStageServer
) -> None:
    # The copy holds its thread until the test opens the gate, which it does only once another
    # call was answered: a copy on the event loop can never see the gate open (it times out).
    slow = SlowCopies(seconds=10.0, gated=True)
    server.servicer.copies = slow
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        forward = asyncio.create_task(_call(stub.Forward, _forward(job)))
        await asyncio.wait_for(copy_started(slow), 30)
        info = await stub.Info(pb.StageInfoRequest(), timeout=30)
        answered_during_copy = not slow.copies  # the copy has not finished yet
        slow.gate.set()
        (reply,) = await forward
    assert info.peer == server.servicer.peer
    assert answered_during_copy, "Info was answered only after the copy had ended"
    assert slow.copies == [True], "the copy blocked the event loop until it timed out"
    assert threading.main_thread().name not in slow.threads  # the loop's thread never copied
    out = codec.decode(reply.tensors[0])
    assert out.shape == (4, 16, 32) and out.dtype == torch.float64


async def test_a_push_sends_its_outputs_on_without_the_loop_waiting_on_their_copy(
    tmp_path: Path,
) -> None:
    # The push plane: stage 1 computes, copies its outputs to the host and sends them on to
    # stage 2 (the last) along the same call. While stage 1's copy is slow, its loop answers.
    job = make_job(tmp_path, training={"stages": 3}, runtime={"data_plane": "push"})
    first = await start_stage_server(job, StageServerOptions(stage=1, metrics_port=0))
    last = await start_stage_server(job, StageServerOptions(stage=2, metrics_port=0))
    slow = SlowCopies(seconds=10.0, gated=True)
    first.servicer.copies = slow
    onward = pb.Route(peers=[last.servicer.peer], addresses=[last.address], throughput=[1.0])
    request = pb.StagePushRequest(
        job=fingerprint(job),
        stage=1,
        microbatch=pb.MicrobatchId(step=0, index=0),
        tensors=[
            codec.encode(torch.randn(4, 16, 32, dtype=torch.float64), "inputs"),
            codec.encode(torch.zeros(4, 16, dtype=torch.int64), "targets"),
        ],
        accumulate=[1, 2],
        route=[onward],
        need_grad_inputs=True,
    )
    try:
        async with grpc.aio.insecure_channel(first.address) as channel:
            stub = stage_pb2_grpc.StageServiceStub(channel)
            push = asyncio.create_task(_call(stub.Push, request))
            await asyncio.wait_for(copy_started(slow), 30)
            info = await stub.Info(pb.StageInfoRequest(), timeout=30)
            answered_during_copy = not slow.copies
            slow.gate.set()
            (reply,) = await push
    finally:
        await first.stop()
        await last.stop()
    assert info.peer == first.servicer.peer
    assert answered_during_copy, "Info was answered only after the copy had ended"
    assert slow.copies[0] is True, "the copy blocked the event loop until it timed out"
    assert sorted(r.stage for r in reply.receipts) == [1, 2]  # stage 2 took what was copied
    grad = codec.decode(reply.tensors[0])
    assert grad.shape == (4, 16, 32) and torch.isfinite(grad).all()


async def test_the_loop_wakes_on_time_during_a_slow_copy(
    job: JobConfig, server: RunningStageServer
) -> None:
    """A probe on the server's loop measures how late each of its wakeups is while a Forward's
    0.5 s copy runs: the goal is 50 ms; the bound asserted is half the copy, which a copy on the
    loop always exceeds and a loaded test machine does not."""
    slow = SlowCopies(seconds=0.5)
    server.servicer.copies = slow
    lags: list[float] = []
    stop = asyncio.Event()

    async def probe() -> None:
        while not stop.is_set():
            before = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append(time.perf_counter() - before - 0.01)

    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        probing = asyncio.create_task(probe())
        (reply,) = await _call(stub.Forward, _forward(job))
        stop.set()
        await probing
    assert slow.copies == [True] and reply.tensors
    worst = max(lags)
    print(f"worst event-loop wakeup lag during a 0.5 s copy: {worst * 1000:.1f} ms")
    assert worst < 0.25, f"the loop waited {worst:.3f} s on the device's copy"
