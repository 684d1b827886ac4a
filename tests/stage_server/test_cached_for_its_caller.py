"""A microbatch's cached activations serve the Backward of the caller whose Forward made them:
another token holder's Forward of the same `(step, index)` (any peer operator may call a stage's
RPCs) replaced them, and the honest trainer's Backward then differentiated the other's inputs.
Its gradient went into the step wrong, and an audit of it banned the honest replica (its answer
is not the re-execution of the trainer's inputs). Now each caller's Forward keeps its own, and
each Backward differentiates its own caller's. Real stage servers on real ports, two callers on
two connections."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from stage_server.server import StageServerOptions, start_stage_server
from swarm.job.fingerprint import fingerprint
from swarm.proto import stage_pb2_grpc
from swarm.rpc.stage_client import StageClient
from swarm.wire import codec
from swarm.wire.chunking import grpc_options
from swarm.wire.crossing import Crossing
from tests.support.jobs import make_job

pytestmark = [pytest.mark.timeout(120), pytest.mark.attack("cache-caller")]


async def test_another_callers_forward_does_not_replace_the_activations_of_a_backward(
    tmp_path: Path,
) -> None:
    job = make_job(tmp_path, training={"stages": 3}, runtime={"data_plane": "relay"})
    shape = (job.training.microbatch_size, job.model.seq_len, job.model.d_model)
    honest_x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    forged_x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    grad = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    running = await start_stage_server(job, StageServerOptions(stage=1))
    trainer, other = (StageClient(running.address, job, fingerprint(job), 1) for _ in range(2))
    # The other on a connection of its own, as another process's is (in one process, gRPC's
    # channels to one address share one connection)
    await other.close()
    own = [*grpc_options(job.runtime.max_message_bytes), ("grpc.use_local_subchannel_pool", 1)]
    other.channel = grpc.aio.insecure_channel(running.address, options=own)
    other.stub = stage_pb2_grpc.StageServiceStub(other.channel)
    try:
        # the reference: the trainer's own Forward and Backward, nobody between them
        await trainer.forward(0, 0, Crossing(honest_x))
        done = await trainer.backward(0, 0, None, grad, accumulate=False)
        assert done.grad_inputs is not None
        honest = codec.decode(done.grad_inputs)
        # the same microbatch again (its index 1), a forged Forward of it between the two
        await trainer.forward(0, 1, Crossing(honest_x))
        await other.forward(0, 1, Crossing(forged_x))
        again = await trainer.backward(0, 1, None, grad, accumulate=False)
        assert again.grad_inputs is not None
        assert torch.equal(codec.decode(again.grad_inputs), honest)
        # the other's own Backward still finds what its Forward made
        theirs = await other.backward(0, 1, None, grad, accumulate=False)
        assert theirs.grad_inputs is not None
        assert not torch.equal(codec.decode(theirs.grad_inputs), honest)
    finally:
        for client in (trainer, other):
            await client.close()
        await running.stop()
