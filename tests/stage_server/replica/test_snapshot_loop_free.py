"""A state download never makes the event loop wait on the device (issue 41, item 3): a live
stage server (real gRPC on a free port, in this process) whose state lies on a slow device
(`tests.support.fake_device.GatedCopies` behind the snapshot's `ChunkCopies` seam) copies each
chunk to the host off the loop, so the loop answers another call while a chunk's copy is under
way, and the joiner still gets the state bit for bit.

The slow copy holds its thread until the test opens the gate, which it does only once the other
call was answered: a copy on the loop can never see the gate open (it times out). On CUDA
(skipped without it) a server on the GPU copies its chunks with torch's own copies off the loop,
on its device."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import torch

from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc
from swarm.rpc.stage_client import StageClient
from tests.support.fake_device import GatedCopies, WatchedCopies, copy_started

pytestmark = pytest.mark.timeout(120)


async def test_the_loop_answers_another_call_while_a_download_copies_a_chunk(
    job: JobConfig, server: RunningStageServer
) -> None:
    gated = GatedCopies("to_host", seconds=5.0)
    server.runtime.snapshots.copies = gated  # the state's tensors taken for a device's
    want = {k: v.clone() for k, v in server.runtime.export_state(True).items()}
    client = StageClient(server.address, job, fingerprint(job), 1)
    try:
        expect = server.runtime.checks.state
        download = asyncio.create_task(client.download_state(True, "", expect=expect))
        await asyncio.wait_for(copy_started(gated), 30)
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = stage_pb2_grpc.StageServiceStub(channel)
            info = await stub.Info(pb.StageInfoRequest(), timeout=30)
        answered_during_copy = gated.opened is None
        gated.gate.set()
        step, state = await asyncio.wait_for(download, 30)
    finally:
        await client.close()
    assert info.peer == server.servicer.peer
    assert answered_during_copy, "Info was answered only after the chunk's copy had ended"
    assert gated.opened is True, "the copy blocked the event loop until it timed out"
    assert threading.main_thread().name not in gated.threads  # the loop's thread never copied
    assert step == server.runtime.step
    assert state.keys() == want.keys()
    assert all(torch.equal(state[k], want[k]) for k in want)  # bit for bit
    assert gated.to_host_bytes > 0  # the state did cross through the fake device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_on_cuda_a_download_copies_its_chunks_off_the_loop(job: JobConfig) -> None:
    index = torch.cuda.device_count() - 1  # the last GPU: a thread starts on cuda:0
    opts = StageServerOptions(stage=1, metrics_port=0, device=f"cuda:{index}")
    running = await start_stage_server(job, opts)
    watched = WatchedCopies()
    running.runtime.snapshots.copies = watched
    want = {k: v.cpu() for k, v in running.runtime.export_state(True).items()}
    want_step = running.runtime.step
    client = StageClient(running.address, job, fingerprint(job), 1)
    try:
        expect = running.runtime.checks.state
        step, state = await asyncio.wait_for(client.download_state(True, "", expect=expect), 60)
    finally:
        await client.close()
        await running.stop()
    assert step == want_step and state.keys() == want.keys()
    assert all(torch.equal(state[k].cpu(), want[k]) for k in want)  # bit for bit
    assert watched.threads and threading.main_thread().name not in watched.threads
    assert watched.devices == {index}
