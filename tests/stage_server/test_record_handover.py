"""A push's record where its hop is handed over (issue 69): real stage servers in this process
(two stages, one site: the shared-memory handover between them), a job that audits every
microbatch, so each keeps a record of every run.

The records' price on a co-located hop was not their digests alone: the gradient went back on
the wire (the caller's slot was left unused wherever a record was kept) and the outputs handed
over were made into a message too, for the record's sake. Now the gradient goes into the slot
and each record keeps the payload handed over, the very bytes that crossed, and both sides
still agree on them bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stage_server.replica.push_records import Arrived
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

pytestmark = pytest.mark.timeout(120)

RUN = 11  # the trainer's id of each microbatch's run


def handed(server: RunningStageServer, way: str) -> float:
    metrics = server.servicer.metrics
    return float(metrics._handovers.labels(**metrics.values, way=way)._value.get())


async def push(
    job: JobConfig, first: RunningStageServer, last: RunningStageServer, index: int
) -> None:
    client = StageClient(first.address, job, fingerprint(job), 0)
    m, t = job.training, job.model
    tokens = torch.randint(0, t.vocab_size, (m.microbatch_size, t.seq_len))
    route = (pb.Route(peers=[last.address], addresses=[last.address], throughput=[1.0]),)
    try:
        call: WirePush = PushCall(
            0,
            index,
            Crossing(codec.encode(tokens, "inputs")),
            codec.encode(tokens, "targets"),
            route=route,
            accumulate=(0, 1),
            run=RUN,
        )
        await client.push(call, timeout=60)
    finally:
        await client.close()


async def record(
    job: JobConfig, server: RunningStageServer, stage: int, index: int
) -> tuple[pb.Commitment, dict[str, tensor_pb2.Tensor]]:
    client = StageClient(server.address, job, fingerprint(job), stage)
    try:
        return await client.record(0, index, RUN, tensors=True)
    finally:
        await client.close()


def _same(a: tensor_pb2.Tensor, b: tensor_pb2.Tensor) -> bool:
    """The same bytes in the same encoding."""
    fields = ("dtype", "shape", "codec", "block_size", "data")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


async def test_a_handed_over_hop_keeps_its_records_in_the_bytes_that_crossed(
    tmp_path: Path,
) -> None:
    job = make_job(
        tmp_path,
        training={"stages": 2, "dtype": "float32"},
        runtime={"data_plane": "push"},
        trust={"audit_fraction": 1.0},
    )
    first = await start_stage_server(job, StageServerOptions(stage=0))
    last = await start_stage_server(job, StageServerOptions(stage=1))
    try:
        await push(job, first, last, 0)  # stage 1 answers its site: the next is handed over
        await push(job, first, last, 1)
        assert handed(first, "offered") >= 1 and handed(last, "taken") >= 1
        # The gradient went into stage 0's slot, though stage 1 keeps a record of the run (on
        # the old code: the wire, never filled)
        assert handed(last, "filled") >= 1
        # Stage 0 kept the outputs it handed over as their payload: no message made for them
        kept = first.servicer._push.records.get(0, 1, RUN).tensors["outputs"]
        assert isinstance(kept, Arrived) and isinstance(kept.payload, torch.Tensor)
        (c0, at0), (c1, at1) = await record(job, first, 0, 1), await record(job, last, 1, 1)
    finally:
        await first.stop()
        await last.stop()
    # Both sides of the boundary hold the same bytes, either way, and commit to them alike
    assert _same(at0["outputs"], at1["inputs"]) and c0.outputs == c1.inputs
    assert _same(at0["grad_outputs"], at1["grad_inputs"]) and c0.grad_outputs == c1.grad_inputs
    for c, at in ((c0, at0), (c1, at1)):
        for name, msg in at.items():
            assert getattr(c, name) == digest(codec.decode(msg)), name
