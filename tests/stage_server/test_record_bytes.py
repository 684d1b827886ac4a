"""A push-plane record (`stage_server.replica.push_records`) travels back to the trainer as its
tensors crossed the boundary: real stage servers on real ports, a job whose boundary is lossy
(`[compression] wire = "hadamard3"`), one microbatch pushed through them and their records asked
for. Re-encoded without loss, what came in in `hadamard3` took several times the bytes it took
on the wire (float32 for about 3.1 bits a value), on the trainer's own link."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.proto import stage_pb2 as pb
from swarm.proto import tensor_pb2
from swarm.rpc.push_call import PushCall
from swarm.rpc.stage_client import StageClient, WirePush
from swarm.wire import codec
from swarm.wire.crossing import Crossing
from swarm.wire.digest import digest
from tests.support.jobs import make_job

RUN = 7  # the trainer's id of the microbatch's run


@pytest.fixture(params=[4 << 20, 256], ids=["whole", "chunked"])
async def servers(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[JobConfig, list[RunningStageServer]]]:
    """Three stage servers of a `hadamard3` job that audits every microbatch; the trainer's
    messages whole, or in chunks (`runtime.chunk_bytes`: the inputs come in several, kept in
    the buffer they were assembled in)."""
    job = make_job(
        tmp_path,
        training={"stages": 3, "dtype": "float32"},
        runtime={"data_plane": "push", "chunk_bytes": request.param},
        compression={"wire": "hadamard3"},
        trust={"audit_fraction": 1.0},
    )
    running: list[RunningStageServer] = []
    try:
        for stage in range(3):
            running.append(await start_stage_server(job, StageServerOptions(stage=stage)))
        yield job, running
    finally:
        for s in running:
            await s.stop()


def _same(a: tensor_pb2.Tensor, b: tensor_pb2.Tensor) -> bool:
    """The same bytes in the same encoding."""
    fields = ("dtype", "shape", "codec", "block_size", "data")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


async def test_a_record_holds_what_came_in_as_it_crossed_the_boundary(
    servers: tuple[JobConfig, list[RunningStageServer]],
) -> None:
    job, running = servers
    job_id, m, t = fingerprint(job), job.training, job.model
    hadamard = codec.codec_from_name("hadamard3")
    x = torch.randn(
        m.microbatch_size, t.seq_len, t.d_model, generator=torch.Generator().manual_seed(0)
    )
    inputs = codec.encode(x, "inputs", hadamard, job.compression.block_size)
    targets = torch.randint(0, t.vocab_size, (m.microbatch_size, t.seq_len))
    last = running[2].address
    clients = [StageClient(running[k].address, job, job_id, k) for k in (1, 2)]
    try:
        route = [pb.Route(peers=[last], addresses=[last])]
        call: WirePush = PushCall(
            0, 0, Crossing(inputs), targets, route=tuple(route), need_grad_inputs=True, run=RUN
        )
        await clients[0].push(call, timeout=120)
        (c1, at1), (c2, at2) = [await c.record(0, 0, RUN, tensors=True) for c in clients]
    finally:
        for c in clients:
            await c.close()
    # Stage 1's inputs: the trainer's very message, not float32 (4 bytes a value) again.
    assert _same(at1["inputs"], inputs), (at1["inputs"].codec, at1["inputs"].nbytes, inputs.nbytes)
    assert at1["inputs"].nbytes < x.numel() * 4 / 5
    # What crossed between stages 1 and 2, either way, as it crossed: the message sent is the
    # message the receiver keeps, in the boundary's codec both ways.
    assert _same(at2["inputs"], at1["outputs"]) and at2["inputs"].codec == hadamard
    assert _same(at1["grad_outputs"], at2["grad_inputs"])
    assert at1["grad_outputs"].codec == hadamard
    # The targets, passed on beside, as they came; the last stage's "gradient" is its targets.
    assert codec.decode(at2["targets"]).equal(targets)
    assert _same(at2["grad_outputs"], at2["targets"])
    # Each decodes bitwise to the tensor committed to (the trainer's check, unchanged).
    for c, at in ((c1, at1), (c2, at2)):
        for name, msg in at.items():
            assert getattr(c, name) == digest(codec.decode(msg)), name
    assert c1.inputs == digest(codec.decode(inputs))
