"""A follower's update yields to the boundary on the source's uplink (issue 67 item 3,
`stage_server.peer.uplink`), on a real stage server over real gRPC: a boundary tensor the replica
sends claims its link, and an Updates answer asked for meanwhile waits until those bytes are
through at the link's rate, where before it went at once and shared the link with them. So does
a state download (a joiner's or a standby's copy, a checkpoint's), held but not paced: one held
is no measure of the link, one sent at once still is."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from stage_server.averaging import staging as staging_module
from stage_server.peer.uplink import LEARNED_SHARE
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


def staging_sizes() -> int:
    """The chunk sizes this process keeps pinned staging buffers for."""
    return staging_module._shared.cache_info().currsize


@pytest.fixture
async def client(job: JobConfig, server: RunningStageServer) -> AsyncIterator[StageClient]:
    stub = StageClient(server.address, job, fingerprint(job), 1)
    yield stub
    await stub.close()


async def test_an_update_waits_for_the_boundary_tensors_on_the_link(
    server: RunningStageServer, client: StageClient
) -> None:
    metrics = server.servicer.metrics
    metrics.link.fix(UP, 0.0)
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
    assert update.step == 0
    assert waited >= CLAIM / UP  # not before the boundary's bytes were through


async def test_with_the_link_rate_unknown_an_update_goes_at_once(
    server: RunningStageServer, client: StageClient
) -> None:
    metrics = server.servicer.metrics
    hidden = torch.randn(4, 16, 32, dtype=torch.float64)
    out = as_tensor(await client.forward(0, 0, Crossing(hidden)))
    await client.backward(0, 0, None, torch.ones_like(out))
    server.runtime.updates.follow("f", 0)
    await client.commit(0, [0], 4, phase=pb.COMMIT_PHASE_PREPARE)
    await client.commit(0, [], 0, phase=pb.COMMIT_PHASE_APPLY)
    metrics.sent(100 * CLAIM, CLAIM, "forward", 1)  # no rate: it claims nothing
    assert metrics.uplink.busy_until() <= time.monotonic()
    (update,) = await client.updates("f", 0, expect=server.runtime.checks.state)
    assert update.step == 0


async def test_a_state_download_waits_for_the_boundary_tensors_on_the_link(
    server: RunningStageServer, client: StageClient
) -> None:
    """A copy taken mid-job went at once beside the boundary's bytes (left open at issue 67)."""
    metrics = server.servicer.metrics
    metrics.link.fix(UP, 0.0)
    metrics.sent(CLAIM, CLAIM, "forward", 0)  # a boundary tensor leaves as the copy is asked
    claimed = time.monotonic()
    step, state = await client.download_state(expect=server.runtime.checks.state)
    waited = time.monotonic() - claimed
    assert step == 0 and state
    assert waited >= CLAIM / UP  # not before the boundary's bytes were through


async def test_a_state_download_sent_at_once_measures_the_link(
    server: RunningStageServer, client: StageClient
) -> None:
    """The control of the test below: with no rate known and nothing claimed, a download goes
    at once, and its bytes over its time are the link meter's sample of the upload."""
    metrics = server.servicer.metrics
    metrics.link.min_bytes["up"] = 1  # this job's small state is a burst large enough
    await client.download_state(expect=server.runtime.checks.state)
    metrics.link.settle(0)
    assert metrics.link.measured("up") > 0


async def test_a_state_download_is_not_paced_so_with_nothing_claimed_it_still_measures_the_link(
    server: RunningStageServer, client: StageClient
) -> None:
    """A download paced at the lane's rate would take that rate's time, never read a faster
    link, and so leave the meter (what the peer announces) at a rate it once read too low, and
    every later download paced at it. It is held for the boundary's claims only."""
    metrics = server.servicer.metrics
    metrics.link.min_bytes["up"] = 1
    slow = 50_000.0  # bytes a second: far below this loopback link
    metrics.uplink.wrote("earlier", 1 << 21, (1 << 21) / slow * LEARNED_SHARE)
    assert metrics.uplink.rate() == pytest.approx(slow)
    await client.download_state(expect=server.runtime.checks.state)
    metrics.link.settle(0)
    assert metrics.link.measured("up") > slow
    # Nor cut to the lane's rate: a device's download stages its chunks in pinned buffers the
    # process keeps for each chunk size (`staging`), so a size that followed the rate would pin
    # more host memory at every new rate, for good.
    sizes = staging_sizes()
    for fast in (8e6, 16e6):  # rates whose parts of `PART_S` would differ (above their floor)
        metrics.uplink.wrote(f"at {fast:g}", 1 << 21, (1 << 21) / fast * LEARNED_SHARE)
        await client.download_state(expect=server.runtime.checks.state)
        assert staging_sizes() == sizes, fast


async def test_a_held_state_download_is_no_measure_of_the_link(
    server: RunningStageServer, client: StageClient
) -> None:
    """A download the lane held back took the lane's time, not only the link's: as a sample it
    would read the link slower than it is (and the lane would then pace the updates at that)."""
    metrics = server.servicer.metrics
    metrics.link.min_bytes["up"] = 1
    metrics.uplink.wrote("earlier", 1 << 21, (1 << 21) / UP)  # a rate from earlier answers
    metrics.sent(CLAIM, CLAIM, "forward", 0)
    await client.download_state(expect=server.runtime.checks.state)
    metrics.link.settle(0)
    assert metrics.link.measured("up") == 0.0
