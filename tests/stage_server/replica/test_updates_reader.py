"""An Updates answer whose reader stops taking it ends within `rpc_timeout_s`, and lets go of the
updates it holds.

A follower with a valid ticket (a joiner, a standby) asks its source for the updates it lacks;
each is a stage's summed gradient. One that took a part and then read nothing more, its
connection open, held the answer's updates for as long as the connection lived, after the
update log itself had let them go: each such call a stage's gradients a step, kept. A state
download has both an idle and a whole bound (`stage_server.replica.download_places`); the
updates had neither. Real stage server, real gRPC, a reader that stops. (Its caller is told
nothing: a cancelled gRPC handler sends no status, and the reader's own client gives up at its
idle bound, `rpc_timeout_s`.)"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import grpc
import pytest
import torch

from stage_server.server import RunningStageServer
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc
from swarm.rpc.state_streams import Update
from tests.support.jobs import make_job
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

STALL_S = 1.0  # the job's rpc_timeout_s
ELEMENTS = 16 * 2**20  # a 64 MiB update: far past what gRPC's windows take unread


@pytest.fixture
def job(tmp_path: Path) -> JobConfig:
    """The middle stage's job (`tests.support.middle_stage`: its `server`), readers given 1 s."""
    return make_job(tmp_path, training={"stages": 3}, runtime={"rpc_timeout_s": STALL_S})


async def test_an_updates_reader_that_stops_reading_is_let_go(
    job: JobConfig, server: RunningStageServer
) -> None:
    log = server.runtime.updates
    log.follow("f", 0)
    log.record(Update(0, [torch.ones(ELEMENTS)], 8))
    kept = weakref.ref(log.since("f", 0)[0].grad_sums[0])
    # as a peer's client takes the server's chunks (`swarm.rpc.channels`)
    options = [("grpc.max_receive_message_length", 2 * server.servicer.limits.chunk_bytes)]
    async with grpc.aio.insecure_channel(server.address, options=options) as channel:
        call = stage_pb2_grpc.StageServiceStub(channel).Updates(
            pb.StageUpdatesRequest(job=fingerprint(job), stage=1, follower="f", from_step=0)
        )
        first = await call.read()
        assert first is not grpc.aio.EOF and first.step == 0  # it takes one part, no more
        log.clear()  # the log lets the update go (a rollback, say): only the answer holds it

        def released() -> bool:
            gc.collect()
            return kept() is None

        # Before: held for as long as the connection lived. (Collected here so that the test
        # does not hang on when the collector runs: the call's generators are let go as its
        # task ends, and closed as they are collected.)
        await wait_until(
            released, "the stalled answer lets go of its update", timeout_s=5 * STALL_S, every_s=0.2
        )
