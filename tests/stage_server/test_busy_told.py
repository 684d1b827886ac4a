"""A data-plane call refused Busy is told Busy, with its cause, every time: never INTERNAL.

A replica refuses a call past its receive budget from the request's header, while its client is
still streaming the body; grpc-aio reported a client write that raced that early end as
"Internal error from Core" in place of the refusal (grpc/grpc#36066), so the trainer met a
`RemoteError` where it would have tried another replica. A real stage server, the trainer's
own `StageClient`, many calls so that the race is run (`swarm.net.refused_streams`)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from stage_server.peer.limits import PeerLimits
from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.errors import Busy, InvalidArgument, SwarmError
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.rpc.stage_client import StageClient
from swarm.wire.crossing import Crossing
from tests.support.jobs import make_job
from tests.support.middle_stage import MIDDLE

pytestmark = pytest.mark.timeout(240)

KiB = 1 << 10
CALLS = 300
"""Refused calls a test: on the old servicer 257 of 300 Forwards and every LoadState were
INTERNAL (a `RemoteError`)."""
CAUSE = "bytes for received bodies are in use (--receive-budget-bytes)"
NOT_OURS = "has no parameter 'param/nothing'"


async def test_a_forward_past_the_receive_budget_is_told_busy_every_time(
    tmp_path: Path,
) -> None:
    # One microbatch's inputs are 16 KiB (4 x 16 x 32 float64), streamed in 1 KiB chunks. All
    # but 8 KiB of the budget is held (as by other calls, or the pool's averaging, which share
    # it): each is refused from its header, with most of its chunks still to be written.
    job = make_job(
        tmp_path,
        training={"stages": 3},
        runtime={"chunk_bytes": KiB, "max_message_bytes": 64 * KiB},
    )
    limits = PeerLimits(max_tensor_bytes=64 * KiB, receive_budget_bytes=64 * KiB)
    running = await start_stage_server(job, StageServerOptions(stage=1, limits=limits))
    others = running.servicer.budget.hold()
    others.reserve(56 * KiB)
    client = StageClient(running.address, job, fingerprint(job), 1)
    told: Counter[str] = Counter()
    try:
        inputs = torch.randn(4, 16, 32, dtype=torch.float64)
        for index in range(CALLS):
            with pytest.raises(SwarmError) as refused:
                await client.forward(0, index, Crossing(inputs))
            error = refused.value
            told[type(error).__name__ if isinstance(error, Busy) else str(error)] += 1
            assert not isinstance(error, Busy) or CAUSE in str(error), error
    finally:
        await client.close()
        await running.stop()
    assert told == {"Busy": CALLS}
    others.release()
    assert running.servicer.budget.in_use == 0  # what a refused call sent is held by none


async def test_a_load_state_refused_mid_stream_is_told_why_every_time(
    server: RunningStageServer, job: JobConfig
) -> None:
    """The same race in LoadState: a state whose first tensor is none of the stage's is refused
    (INVALID_ARGUMENT) once that tensor is read, while its client still writes the others."""
    runtime = server.servicer.runtime
    state = {"param/nothing": torch.zeros(16, dtype=torch.float64)}
    state |= runtime.export_state(include_optimizer=False)
    client = StageClient(server.address, job, server.servicer.job_id, MIDDLE)
    told: Counter[str] = Counter()
    try:
        for _ in range(CALLS):
            with pytest.raises(SwarmError) as refused:
                await client.load_state(runtime.step, state)
            error = refused.value
            named = isinstance(error, InvalidArgument) and NOT_OURS in str(error)
            told["told why" if named else str(error)] += 1
    finally:
        await client.close()
    assert told == {"told why": CALLS}
