"""A state download (a checkpoint's, a joiner's copy) has a whole-transfer deadline besides the
one that follows progress: a member that trickles a few bytes just inside `rpc_timeout_s` each is
cut off once the stage's bound at the minimum rate has passed (N12: such a member kept a
checkpoint in progress forever, so every later one was skipped)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch

from swarm.errors import PeerUnavailable
from swarm.model.stage_state import initial_state
from swarm.model.state_checks import StateChecks
from swarm.proto import stage_pb2, stage_pb2_grpc
from swarm.rpc.state_streams import ReplicaStreams
from tests.support.hostile import HostileStage, serving
from tests.support.jobs import make_job

pytestmark = [pytest.mark.timeout(60), pytest.mark.attack("N12")]

IDLE_S = 1.0  # the deadline that follows progress (rpc_timeout_s)
PAUSE_S = 0.3  # between the trickle's chunks: well within IDLE_S
FLOOR_S = 1.5  # the whole transfer's least deadline


async def _nothing(step: int, name: str, tensor: torch.Tensor) -> None:
    pass


async def test_a_trickling_member_is_cut_off_at_the_whole_transfers_deadline(
    tmp_path: Path,
) -> None:
    job = make_job(tmp_path)
    expect = StateChecks(job, 1)
    whole = initial_state(job, 1)
    # 8-byte chunks, each in time for the idle deadline, the whole far longer than any deadline.
    trickle = HostileStage(lambda: whole.items(), step=3, chunk_bytes=8, pause_s=PAUSE_S)
    assert max(v.nbytes for v in whole.values()) // 8 * PAUSE_S > 10 * FLOOR_S
    # A minimum rate so high that the floor is the deadline.
    streams_of = lambda address: ReplicaStreams(  # noqa: E731
        1, address, IDLE_S, 1 << 30, min_rate=1 << 40, floor_s=FLOOR_S
    )
    loop = asyncio.get_running_loop()
    async with serving(trickle) as address:
        channel = grpc.aio.insecure_channel(address)
        started = loop.time()
        try:
            call = stage_pb2_grpc.StageServiceStub(channel).DownloadState(
                stage_pb2.StageDownloadStateRequest(job="job", stage=1, include_optimizer=True)
            )
            with pytest.raises(
                PeerUnavailable, match=rf"stage 1's replica at {address} .* within 1\.5s"
            ):
                # Bounded itself: the old code read the trickle for as long as it lasted.
                received = streams_of(address).receive_state(call, expect, _nothing)
                await asyncio.wait_for(received, 10 * FLOOR_S)
            assert loop.time() - started < FLOOR_S + IDLE_S
            await asyncio.wait_for(trickle.ended.wait(), 10)
            assert trickle.cut  # the sender was cancelled
        finally:
            await channel.close()
