"""Data-plane headers that declare a body and send none hold none of a replica's receive budget
(issue 44, N6, as for the pool's Reduce: `tests/stage_server/averaging/test_hostile_reduce.py`):
an honest Forward is still served."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch

from stage_server.peer.limits import PeerLimits
from stage_server.server import StageServerOptions, start_stage_server
from swarm.job.fingerprint import fingerprint
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc, tensor_pb2
from swarm.wire import codec
from tests.support.jobs import make_job

pytestmark = [pytest.mark.timeout(120), pytest.mark.attack("N6")]

KiB = 1 << 10


async def test_forward_headers_that_send_no_body_hold_no_budget(tmp_path: Path) -> None:
    # A 64 KiB budget; one microbatch's inputs are 16 KiB (4 x 16 x 32 float64). Four callers
    # declare those inputs and send nothing. Before the fix each held its 16,896 bytes (with
    # the tensor's overhead) until rpc_timeout_s: three fill the budget, an honest Forward Busy.
    job = make_job(tmp_path, training={"stages": 3})
    limits = PeerLimits(max_tensor_bytes=64 * KiB, receive_budget_bytes=64 * KiB)
    running = await start_stage_server(job, StageServerOptions(stage=1, limits=limits))
    budget = running.servicer.budget
    declared = tensor_pb2.Tensor(name="inputs", dtype="float64", shape=[4, 16, 32], nbytes=16384)

    def forward(index: int, tensor: tensor_pb2.Tensor) -> pb.StageForwardRequest:
        return pb.StageForwardRequest(
            job=fingerprint(job),
            stage=1,
            microbatch=pb.MicrobatchId(step=0, index=index),
            tensors=[tensor],
        )

    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = stage_pb2_grpc.StageServiceStub(channel)
            fakes = [stub.Forward(timeout=60) for _ in range(4)]
            try:
                for i, fake in enumerate(fakes):
                    await fake.write(forward(i, declared))
                for _ in range(2000):  # each header read: it holds its own few bytes
                    if budget.in_use >= 4 * 512 or any(f.done() for f in fakes):
                        break
                    await asyncio.sleep(0.01)
                assert not any(f.done() for f in fakes)
                assert budget.in_use < 16 * KiB, f"{budget.in_use} bytes held for no body"
                inputs = codec.encode(torch.randn(4, 16, 32, dtype=torch.float64), "inputs")
                call = stub.Forward(timeout=30)
                await call.write(forward(9, inputs))
                await call.done_writing()
                (reply,) = [m async for m in call]
                assert codec.decode(reply.tensors[0]).shape == (4, 16, 32)
            finally:
                for fake in fakes:
                    fake.cancel()
        for _ in range(500):
            if budget.in_use == 0:
                break
            await asyncio.sleep(0.01)
        assert budget.in_use == 0
    finally:
        await running.stop()
