"""A rollback's state load retires the work leased before it (`swarm.rpc.epoch`).

Two rollbacks to step 0 within moments (a ban just after a first rollback reopened the step):
a trainer still runs a task of step 0 leased between them, through the peer about to be
banned. Its Backward lands at a replica after the second rollback loaded step 0's state again.
Accumulated, it was a gradient off the banned peer's path in the replayed step, and the replay's
own copy of the microbatch was answered as a duplicate: the model left `swarm local`'s (0.17 to
0.21 in the poison bench). A real stage server on a real port, driven as the trainer and the
coordinator drive it, in that order: no timing luck."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from stage_server.replica.runtime import StageRuntime
from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.errors import FailedPrecondition
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.rpc import epoch
from swarm.rpc.lease import Lease, Task, lease_from_proto, lease_to_proto
from swarm.rpc.stage_client import StageClient
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(60)

BEFORE, AFTER = 5, 6  # the epochs a task was leased in: before the rollback and after it


@pytest.fixture
def job(tmp_path: Path) -> JobConfig:
    return make_job(tmp_path, training={"stages": 3})


@pytest.fixture
async def server(job: JobConfig) -> AsyncIterator[RunningStageServer]:
    running = await start_stage_server(job, StageServerOptions(stage=1, metrics_port=0))
    yield running
    await running.stop()


async def test_a_backward_leased_before_a_rollback_is_refused_once_its_state_loads(
    job: JobConfig, server: RunningStageServer
) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 16, 32, dtype=torch.float64)
    stale, replayed = torch.randn_like(x), torch.randn_like(x)  # the banned path's, the replay's
    state = server.runtime.export_state()  # step 0's: what the rollback loads again
    client = StageClient(server.address, job, fingerprint(job), 1)
    try:
        epoch.leased_in(BEFORE)  # a task leased between the two rollbacks
        await client.forward(0, 7, x)
        await client.load_state(0, state, rollback_epoch=AFTER)  # the second rollback
        with pytest.raises(FailedPrecondition, match="leased before a rollback"):
            await client.backward(0, 7, x, stale)  # its Backward lands after the load
        assert server.runtime.receipts(0) == {}

        epoch.leased_in(AFTER)  # the replay of microbatch 7, leased after the rollback
        done = await client.backward(0, 7, x, replayed)
        assert not done.receipt.duplicate
        assert server.runtime.receipts(0) == {7: 4}
    finally:
        await client.close()
    # The step's sums are the replay's gradient alone: a replica that never saw the stale call
    # holds the same, bit for bit.
    alone = StageRuntime(job, 1)
    alone.load_state(0, state)
    alone.backward(0, 7, x, replayed)
    held, expected = server.runtime.sums.accum_or_zeros(0), alone.sums.accum_or_zeros(0)
    assert all(torch.equal(a, b) for a, b in zip(held, expected, strict=True))


async def test_a_newer_epoch_in_a_call_retires_no_work(
    job: JobConfig, server: RunningStageServer
) -> None:
    """Only a rollback's LoadState (the scheduler's) moves a replica's epoch: on the push plane a
    peer names the epoch of the push it sends on, and a liar's far-off one must not have the
    replica refuse the honest work that follows."""
    x = torch.randn(4, 16, 32, dtype=torch.float64)
    client = StageClient(server.address, job, fingerprint(job), 1)
    try:
        epoch.leased_in(2**62)  # a liar's
        await client.backward(0, 1, x, torch.ones_like(x))
        epoch.leased_in(BEFORE)  # the job's own, no rollback since
        await client.backward(0, 2, x, torch.ones_like(x))
        assert server.runtime.receipts(0) == {1: 4, 2: 4}
    finally:
        await client.close()


def test_a_tasks_epoch_travels_with_its_lease() -> None:
    """A remote trainer's calls carry the epoch its lease said (tasks compare without it)."""
    task = Task(3, 1, frozenset({0, 1}), epoch=AFTER)
    (back,) = lease_from_proto(lease_to_proto(Lease(3, [task], []))).tasks
    assert back == task and back.epoch == AFTER
