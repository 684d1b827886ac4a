"""A data-plane call refused for its token is told so, every time: never INTERNAL.

The token check (`swarm.net.tokens`, an interceptor) refuses a call from its header; it reads a
refused stream first, briefly and a few at once, and answers the rest unread, while their
clients still write the body: grpc-aio told those clients "Internal error from Core" in place of
UNAUTHENTICATED (grpc/grpc#36066), the refusal's text lost. The refusal is now told ahead of its
status too (`swarm.net.told_ahead`). A real stage server with a token, the trainer's own
`StageClient` without it, many calls at once so that most go unread."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
import torch

from stage_server.peer.limits import PeerLimits
from stage_server.server import StageServerOptions, start_stage_server
from swarm.errors import RemoteError, SwarmError
from swarm.job.fingerprint import fingerprint
from swarm.rpc.stage_client import StageClient
from swarm.wire.crossing import Crossing
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(240)

KiB = 1 << 10
CALLS, AT_ONCE = 300, 30
"""Calls, that many at once: on the old token check 37 and 39 of 300 were told INTERNAL."""
WHY = "this swarm needs its token"


async def test_a_call_without_the_token_is_told_why_every_time(tmp_path: Path) -> None:
    job = make_job(
        tmp_path,
        training={"stages": 3},
        runtime={"chunk_bytes": KiB, "max_message_bytes": 64 * KiB},
    )
    options = StageServerOptions(stage=1, token="the-token", limits=PeerLimits())
    running = await start_stage_server(job, options)
    client = StageClient(running.address, job, fingerprint(job), 1)  # no token
    told: Counter[str] = Counter()

    async def forward(index: int) -> None:
        inputs = torch.randn(4, 16, 32, dtype=torch.float64)  # 16 KiB: 16 chunks of 1 KiB
        with pytest.raises(SwarmError) as refused:
            await client.forward(0, index, Crossing(inputs))
        error = refused.value
        why = isinstance(error, RemoteError) and error.code == "UNAUTHENTICATED"
        told["told why" if why and WHY in str(error) else str(error)] += 1

    try:
        for start in range(0, CALLS, AT_ONCE):
            await asyncio.gather(*(forward(i) for i in range(start, start + AT_ONCE)))
    finally:
        await client.close()
        await running.stop()
    assert told == {"told why": CALLS}
