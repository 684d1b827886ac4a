"""A data-plane answer whose caller does not read it is held in the receive budget until it is
taken, and let go when its reader takes nothing within the job's `rpc_timeout_s`.

A caller that half-closes a Forward and never reads the answer left the handler parked at its
`yield` with the whole answer (a microbatch's outputs; a Record's copies of a run's tensors)
for as long as its connection lived (4 h by default), and the receive budget had been given
back as the answer was made: a thousand such calls held a thousand answers outside every
bound. Real stage server, real gRPC, a caller that never reads."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch

from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.job.fingerprint import fingerprint
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc
from swarm.wire import chunking, codec
from tests.support.jobs import make_job
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

STALL_S = 1.0  # the job's rpc_timeout_s
MICROBATCH = 4096  # a middle stage's 16 MiB answer (float64): far past what gRPC takes unread


def _answered(running: RunningStageServer) -> float:
    """Forwards the server has answered OK (made their answer; the counter comes before its
    chunks are handed to gRPC)."""
    metrics = running.servicer.metrics
    labels = {**metrics.values, "method": "Forward", "code": "OK"}
    return metrics.registry.get_sample_value("swarm_stage_requests_total", labels) or 0.0


async def test_an_answer_nobody_reads_is_held_in_the_budget_then_let_go(tmp_path: Path) -> None:
    training = {"stages": 3, "microbatch_size": MICROBATCH, "target_batch_size": MICROBATCH}
    job = make_job(tmp_path, training=training, runtime={"rpc_timeout_s": STALL_S})
    running = await start_stage_server(job, StageServerOptions(stage=1))
    budget = running.servicer.budget
    try:
        inputs = torch.randn(MICROBATCH, job.model.seq_len, job.model.d_model, dtype=torch.float64)
        request = pb.StageForwardRequest(
            job=fingerprint(job),
            stage=1,
            microbatch=pb.MicrobatchId(step=0, index=0),
            tensors=[codec.encode(inputs, "inputs")],
        )
        async with grpc.aio.insecure_channel(running.address) as channel:
            call = stage_pb2_grpc.StageServiceStub(channel).Forward()
            for part in chunking.split(request, 1 << 20):
                await call.write(part)
            await call.done_writing()  # and never reads
            # The answer made (the request's body given back, the call counted as answered):
            # its bytes are held while unread. (Before: nothing held once the answer was made.)
            await wait_until(lambda: _answered(running) == 1, "the Forward answered", timeout_s=20)
            held = budget.in_use
            assert inputs.nbytes <= held < 2 * inputs.nbytes, held  # the answer, not the request
            # Let go once its reader took nothing for rpc_timeout_s. (Before: held for as long
            # as the connection lived.)
            await wait_until(
                lambda: budget.in_use == 0, "the unread answer let go", timeout_s=10 * STALL_S
            )
            call.cancel()
        await asyncio.sleep(0)
    finally:
        await running.stop()
