"""A follower's update yields to the boundary on the source's uplink (issue 67 item 3,
`stage_server.peer.uplink`), on a real stage server over real gRPC: a boundary tensor the replica
sends claims its link, and an Updates answer asked for meanwhile waits until those bytes are
through at the link's rate, where before it went at once and shared the link with them."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.proto import stage_pb2 as pb
from swarm.rpc.stage_client import StageClient, as_tensor
from swarm.wire.crossing import Crossing
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(120)

UP = 1_000_000.0  # the source's uplink, bytes a second (as `--bandwidth` would fix it)
CLAIM = 600_000  # a boundary tensor of 0.6 s on that link


@pytest.fixture
def job(tmp_path: Path) -> JobConfig:
    return make_job(tmp_path, training={"stages": 3})


@pytest.fixture
async def server(job: JobConfig) -> AsyncIterator[RunningStageServer]:
    running = await start_stage_server(job, StageServerOptions(stage=1))
    yield running
    await running.stop()


async def test_an_update_waits_for_the_boundary_tensors_on_the_link(
    job: JobConfig, server: RunningStageServer
) -> None:
    metrics = server.servicer.metrics
    metrics.link.fix(UP, 0.0)
    client = StageClient(server.address, job, fingerprint(job), 1)
    try:
        # A step committed with a follower of step 0: one update for it in the log.
        hidden = torch.randn(4, 16, 32, dtype=torch.float64)
        before = metrics.uplink.busy_until()
        out = as_tensor(await client.forward(0, 0, Crossing(hidden)))
        # the forward's outputs are a boundary tensor sent: they claimed the link
        assert metrics.uplink.busy_until() > before
        await client.backward(0, 0, None, torch.ones_like(out))
        server.runtime.updates.follow("f", 0)
        await client.commit(0, [0], 4, phase=pb.COMMIT_PHASE_PREPARE)
        await client.commit(0, [], 0, phase=pb.COMMIT_PHASE_APPLY)

        # The next step's outputs leave as the follower asks: 0.6 s of this link.
        metrics.sent(CLAIM, CLAIM, "forward", 1)
        claimed = time.monotonic()
        (update,) = await client.updates("f", 0, expect=server.runtime.checks.state)
        waited = time.monotonic() - claimed
    finally:
        await client.close()
    assert update.step == 0
    assert waited >= CLAIM / UP  # not before the boundary's bytes were through


async def test_with_the_link_rate_unknown_an_update_goes_at_once(
    job: JobConfig, server: RunningStageServer
) -> None:
    metrics = server.servicer.metrics
    client = StageClient(server.address, job, fingerprint(job), 1)
    try:
        hidden = torch.randn(4, 16, 32, dtype=torch.float64)
        out = as_tensor(await client.forward(0, 0, Crossing(hidden)))
        await client.backward(0, 0, None, torch.ones_like(out))
        server.runtime.updates.follow("f", 0)
        await client.commit(0, [0], 4, phase=pb.COMMIT_PHASE_PREPARE)
        await client.commit(0, [], 0, phase=pb.COMMIT_PHASE_APPLY)
        metrics.sent(100 * CLAIM, CLAIM, "forward", 1)  # no rate: it claims nothing
        assert metrics.uplink.busy_until() <= time.monotonic()
        (update,) = await client.updates("f", 0, expect=server.runtime.checks.state)
    finally:
        await client.close()
    assert update.step == 0
