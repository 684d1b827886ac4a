"""A data-plane call refused Busy is told Busy, with its cause, every time: never INTERNAL.

A replica refuses a call past its receive budget from the request's header, while its client is
still streaming the body; grpc-aio reported a client write that raced that early end as
"Internal error from Core" in place of the refusal (grpc/grpc#36066), so the trainer met a
`RemoteError` where it would have tried another replica. A real stage server, the trainer's
own `StageClient`, many calls so that the race is run (`swarm.net.refused_streams`); and past
the refused streams a replica reads at once, where only what it told ahead of its refusal
reaches the client (`swarm.net.told_ahead`)."""

from __future__ import annotations

import contextlib
import random
import re
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from stage_server.peer.limits import PeerLimits
from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from stage_server.servicer import BUSY_AT_ONCE
from swarm.clock import MonotonicClock
from swarm.errors import Busy, InvalidArgument, SwarmError
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.policy.wiring import Wiring
from swarm.proto import stage_pb2 as pb
from swarm.rpc.hop import HopFailed, hop
from swarm.rpc.lease import Replica
from swarm.rpc.routes import Routes
from swarm.rpc.stage_client import StageClient
from swarm.wire import chunking as wire
from swarm.wire import codec
from swarm.wire.budget import Held
from swarm.wire.crossing import Crossing
from tests.support.jobs import make_job
from tests.support.middle_stage import MIDDLE
from tests.support.waiting import wait_until

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
    job, running, others = await _busy_replica(tmp_path)
    client = StageClient(running.address, job, fingerprint(job), 1)
    try:
        told = await _forwards(client, range(CALLS))
    finally:
        await client.close()
        await running.stop()
    assert told == {"Busy": CALLS}
    others.release()
    assert running.servicer.budget.in_use == 0  # what a refused call sent is held by none


async def test_a_forward_refused_past_the_reads_at_once_is_told_busy_every_time(
    tmp_path: Path,
) -> None:
    """Past the `BUSY_AT_ONCE` refused streams a replica reads at once, a Busy call is answered
    unread: a busy replica's many callers, or callers that stream and never half-close (held
    here, each its 2 s). On the old servicer 253 and 270 of 300 were told INTERNAL (two runs)."""
    job, running, others = await _busy_replica(tmp_path)
    client = StageClient(running.address, job, fingerprint(job), 1)
    told: Counter[str] = Counter()
    try:
        for batch in range(0, CALLS, BATCH):
            async with _reads_held(running, client):
                told += await _forwards(client, range(batch, batch + BATCH))
    finally:
        await client.close()
        await running.stop()
    assert told == {"Busy": CALLS}
    others.release()
    assert running.servicer.budget.in_use == 0


async def test_a_hop_to_a_replica_refusing_past_its_reads_backs_it_off_never(
    tmp_path: Path,
) -> None:
    """The trainer's side (`swarm.rpc.hop`): a refused call told INTERNAL was the replica's own
    error, so a healthy replica that was only busy went into backoff (the wiring's pause), its
    cause "INTERNAL: Internal error from Core", and the call was taken for one that may have
    accumulated (left to the coordinator). Told Busy, it is tried elsewhere and left as it was."""
    job, running, _ = await _busy_replica(tmp_path)
    wiring = Wiring(job.training.stages, clock=MonotonicClock(), rng=random.Random(0))
    routes = Routes(job, fingerprint(job), None, wiring)
    routes.follow(1, [Replica("busy", running.address, 1.0)])
    try:
        for batch in range(0, HOPS, BATCH):
            async with _reads_held(running, routes.clients["busy"]):
                for index in range(batch, batch + BATCH):
                    with pytest.raises(HopFailed, match=re.escape(CAUSE)):
                        await hop(routes, 1, _forward(index), attempts=1, accumulate=True)
                    assert wiring[1].backoff_until("busy") is None, routes.causes.last(1)
    finally:
        await routes.close()
        await running.stop()


BATCH = 25
"""Calls made while the stalled ones are read (their read ends after `BUSY_READ_S`: a few of a
batch may then be read, and told as before)."""
HOPS = 100


async def _busy_replica(tmp_path: Path) -> tuple[JobConfig, RunningStageServer, Held]:
    """A middle stage whose receive budget has room for none of `_forwards`' calls, and what
    holds the rest of it."""
    job = make_job(
        tmp_path,
        training={"stages": 3},
        runtime={"chunk_bytes": KiB, "max_message_bytes": 64 * KiB},
    )
    limits = PeerLimits(max_tensor_bytes=64 * KiB, receive_budget_bytes=64 * KiB)
    running = await start_stage_server(job, StageServerOptions(stage=1, limits=limits))
    others = running.servicer.budget.hold()  # as by other calls, or the pool's averaging
    others.reserve(56 * KiB)
    return job, running, others


def _inputs() -> torch.Tensor:
    """One microbatch's inputs: 16 KiB (4 x 16 x 32 float64), 16 chunks of 1 KiB."""
    return torch.randn(4, 16, 32, dtype=torch.float64)


async def _forwards(client: StageClient, indices: range) -> Counter[str]:
    """Refused Forwards, by what each was told: "Busy" with its cause, or the error."""
    told: Counter[str] = Counter()
    for index in indices:
        with pytest.raises(SwarmError) as refused:
            await client.forward(0, index, Crossing(_inputs()))
        error = refused.value
        told[type(error).__name__ if isinstance(error, Busy) else str(error)] += 1
        assert not isinstance(error, Busy) or CAUSE in str(error), error
    return told


def _forward(index: int) -> Callable[[StageClient, bool], Awaitable[Any]]:
    """A hop's call: microbatch `index`'s Forward."""
    return lambda client, _: client.forward(0, index, Crossing(_inputs()))


@contextlib.asynccontextmanager
async def _reads_held(running: RunningStageServer, client: StageClient) -> AsyncIterator[None]:
    """Every refused stream `running` reads at once taken by a `_stalled` call of `client`'s."""
    streams = running.servicer.busy_streams
    async with contextlib.AsyncExitStack() as stalls:
        for _ in range(BUSY_AT_ONCE):
            await stalls.enter_async_context(_stalled(client))
        await wait_until(lambda: streams.reading == BUSY_AT_ONCE, "the stalled calls read")
        yield


@contextlib.asynccontextmanager
async def _stalled(client: StageClient) -> AsyncIterator[Any]:
    """A Forward whose header is written (refused Busy: the replica reads on, for its half-close),
    then nothing more, until the context ends and the call is cancelled."""
    request = pb.StageForwardRequest(
        job=client.job_id,
        stage=client.stage,
        microbatch=pb.MicrobatchId(step=0, index=0),
        tensors=[codec.encode(_inputs(), "inputs")],
    )
    call = client.stub.Forward(timeout=60)
    try:
        await call.write(next(wire.split(request, KiB)))
        yield call
    finally:
        call.cancel()


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
