"""The stage client's boundary and the coordinator's cache of connections: a call whose channel
is closed under it is a peer that did not answer (never a cancellation of the caller), and
connections of replicas that left are closed only once their calls in flight had their time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from scheduler.coordinator.replicas import ReplicaClients
from swarm.errors import PeerUnavailable
from swarm.proto import stage_pb2, stage_pb2_grpc
from swarm.rpc.lease import Replica
from swarm.rpc.stage_client import StageClient
from swarm.wire import codec
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(60)


class _Hung(stage_pb2_grpc.StageServiceServicer):
    """Info never answers (a frozen replica)."""

    async def Info(  # type: ignore[override]
        self, request: stage_pb2.StageInfoRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.StageInfoResponse:
        await asyncio.sleep(3600)
        return stage_pb2.StageInfoResponse()


async def test_a_call_on_a_closed_channel_is_a_peer_unavailable(tmp_path: Path) -> None:
    server = grpc.aio.server()
    stage_pb2_grpc.add_StageServiceServicer_to_server(_Hung(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = StageClient(f"127.0.0.1:{port}", make_job(tmp_path), "job", 0)
    try:
        call = asyncio.create_task(client.info())
        await asyncio.sleep(0.3)  # in flight
        await client.close()
        with pytest.raises(PeerUnavailable):
            await call
        assert not call.cancelled()  # the caller's task was not the one cancelled
    finally:
        await server.stop(None)


class _Trickle(stage_pb2_grpc.StageServiceServicer):
    """DownloadState sends one small tensor every `pause_s`, `count` times, then (if `stall`)
    nothing more: a large state over a slow link, or a replica that froze mid-transfer."""

    def __init__(self, count: int, pause_s: float, stall: bool) -> None:
        self.count, self.pause_s, self.stall = count, pause_s, stall

    async def DownloadState(  # type: ignore[override]
        self, request: stage_pb2.StageDownloadStateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[stage_pb2.StageDownloadStateResponse]:
        for i in range(self.count):
            await asyncio.sleep(self.pause_s)
            tensor = codec.encode(torch.full((4,), float(i), dtype=torch.float64), f"param/t{i}")
            yield stage_pb2.StageDownloadStateResponse(tensors=[tensor], step=7)
        if self.stall:
            await asyncio.sleep(3600)


@pytest.mark.parametrize("stall", [False, True])
async def test_a_state_download_lasts_while_bytes_come_and_fails_when_they_stop(
    tmp_path: Path, stall: bool
) -> None:
    server = grpc.aio.server()
    stage_pb2_grpc.add_StageServiceServicer_to_server(_Trickle(6, 0.3, stall), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    job = make_job(tmp_path, runtime={"rpc_timeout_s": 0.8, "commit_timeout_s": 1.0})
    client = StageClient(f"127.0.0.1:{port}", job, "job", 0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        if stall:
            with pytest.raises(PeerUnavailable, match=r"no bytes for 0\.8s"):
                await client.download_state()
            assert loop.time() - started < 6 * 0.3 + 3 * 0.8  # soon after the bytes stopped
        else:
            # Longer than either deadline in all: each message came in time, so it ends.
            step, state = await client.download_state()
            assert step == 7 and sorted(state) == [f"t{i}" for i in range(6)]
            assert loop.time() - started > 2 * 0.8
    finally:
        await client.close()
        await server.stop(None)


class _Recorded:
    def __init__(self) -> None:
        self.closed = False

    async def close(self) -> None:
        self.closed = True


async def test_connections_of_replicas_that_left_close_after_a_grace() -> None:
    opened: dict[str, _Recorded] = {}

    def connect(stage: int, replica: Replica) -> _Recorded:
        return opened.setdefault(replica.peer, _Recorded())

    clients = ReplicaClients(connect, grace_s=0.3)  # type: ignore[arg-type]
    a, b = Replica("a", "h:1"), Replica("b", "h:2")
    clients.get(0, a)
    clients.get(0, b)
    await clients.keep([[a]])  # b left
    assert len(clients) == 1
    await asyncio.sleep(0.05)
    assert not opened["b"].closed  # a call to b in flight still has its time
    await asyncio.sleep(0.5)
    assert opened["b"].closed and not opened["a"].closed
    await clients.close()
    assert opened["a"].closed
