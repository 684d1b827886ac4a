"""A data-plane call refused from its header is told why, every time: never INTERNAL.

A replica refuses a streamed call from its header (another job's, a stage it does not serve, a
header it cannot take, a body past a microbatch's size) while its client still writes the body.
grpc-aio reported a client write that raced that early end as "Internal error from Core" in
place of the refusal (grpc/grpc#36066): to the trainer a `RemoteError`, a replica put in backoff
and a call that "may have accumulated" where it took nothing. The refusal is now told ahead of
its status too (`swarm.net.told_ahead`). A real stage server, the trainer's own `StageClient`,
many calls of each so that the race is run."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from stage_server.peer.limits import PeerLimits
from stage_server.server import StageServerOptions, start_stage_server
from swarm.errors import InvalidArgument, NotFound, ResourceExhausted, SwarmError
from swarm.job.fingerprint import fingerprint
from swarm.proto import tensor_pb2
from swarm.rpc.stage_client import StageClient, TensorLike
from swarm.wire import codec
from swarm.wire.crossing import Crossing
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(240)

KiB = 1 << 10
CALLS = 100
"""Calls of each refusal: on the old servicer 399 of the 400 were INTERNAL (a `RemoteError`)."""


def _handed() -> tensor_pb2.Tensor:
    """One microbatch's inputs that say they were handed over (`swarm.device.handover`): a
    Forward takes no handover, and says so from the header."""
    inputs = codec.encode(_inputs(), "inputs")
    inputs.handover.shm = "swarm-ho-0-0"
    return inputs


def _inputs(batch: int = 4) -> torch.Tensor:
    """`batch` samples' inputs, 4 KiB each (16 x 32 float64), in chunks of 1 KiB: 4 are one
    microbatch's; 12 are more than a microbatch's two tensors (32 KiB) can take."""
    return torch.randn(batch, 16, 32, dtype=torch.float64)


async def test_a_forward_refused_from_its_header_is_told_why_every_time(tmp_path: Path) -> None:
    job = make_job(
        tmp_path,
        training={"stages": 3},
        runtime={"chunk_bytes": KiB, "max_message_bytes": 64 * KiB},
    )
    limits = PeerLimits(max_tensor_bytes=64 * KiB)
    running = await start_stage_server(job, StageServerOptions(stage=1, limits=limits))
    ours = fingerprint(job)
    # (client's job and stage, what it sends, the refusal it must be told, words of its text)
    cases: list[tuple[str, int, TensorLike, type[SwarmError], str]] = [
        ("another-job", 1, _inputs(), NotFound, "unknown job 'another-job'"),
        (ours, 2, _inputs(), NotFound, "stage 2 is not served here"),
        (ours, 1, _handed(), InvalidArgument, "a handover is not taken here"),
        (ours, 1, _inputs(12), ResourceExhausted, "the most one microbatch's tensors take"),
    ]
    told: Counter[str] = Counter()
    try:
        for job_id, stage, inputs, refusal, words in cases:
            client = StageClient(running.address, job, job_id, stage)
            try:
                for index in range(CALLS):
                    with pytest.raises(SwarmError) as refused:
                        await client.forward(0, index, Crossing(inputs))
                    error = refused.value
                    why = type(error) is refusal and words in str(error)
                    told[words if why else f"{type(error).__name__}: {error}"] += 1
            finally:
                await client.close()
    finally:
        await running.stop()
    assert told == {words: CALLS for *_, words in cases}
