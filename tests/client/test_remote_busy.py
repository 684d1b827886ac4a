"""A remote trainer against a scheduler at its cap of calls in progress (`max_concurrent_rpcs`):
gRPC answers RESOURCE_EXHAUSTED ("Concurrent RPC limit exceeded!"), a moment's overload (a
stage lost: every slot of every trainer gives its work back at once). The trainer raised it at
once and died with a traceback; it asks again, as it does a scheduler that does not answer. A
call refused for its own size is final still."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from client.remote import RemoteCoordinator
from swarm.errors import ResourceExhausted
from swarm.proto import scheduler_pb2 as spb
from swarm.proto import scheduler_pb2_grpc

pytestmark = pytest.mark.timeout(60)


class _Slow(scheduler_pb2_grpc.SchedulerServiceServicer):
    """GetJob answers after `hold_s`; `oversized`: refused as too large, at once."""

    def __init__(self, hold_s: float, oversized: bool = False) -> None:
        self.hold_s, self.oversized, self.calls = hold_s, oversized, 0

    async def GetJob(
        self, request: spb.SchedulerGetJobRequest, context: grpc.aio.ServicerContext
    ) -> spb.SchedulerGetJobResponse:
        self.calls += 1
        if self.oversized:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "message larger than max")
        await asyncio.sleep(self.hold_s)
        return spb.SchedulerGetJobResponse(job=spb.JobStatus(job=request.job))


async def _serve(servicer: _Slow) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(maximum_concurrent_rpcs=1)
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_a_scheduler_at_its_cap_of_calls_is_asked_again() -> None:
    servicer = _Slow(hold_s=1.0)
    server, address = await _serve(servicer)
    first = RemoteCoordinator(address, "j", retry_for_s=30.0)
    second = RemoteCoordinator(address, "j", retry_for_s=30.0)
    try:
        holding = asyncio.create_task(first.job())
        await asyncio.sleep(0.3)  # the one call the cap allows is in progress
        status = await asyncio.wait_for(second.job(), 20.0)
        assert status.job == "j" and (await holding).job == "j"
        assert servicer.calls >= 2
    finally:
        await first.close()
        await second.close()
        await server.stop(None)


async def test_a_call_refused_for_its_size_is_not_asked_again() -> None:
    servicer = _Slow(hold_s=0.0, oversized=True)
    server, address = await _serve(servicer)
    remote = RemoteCoordinator(address, "j", retry_for_s=30.0)
    try:
        with pytest.raises(ResourceExhausted):
            await asyncio.wait_for(remote.job(), 20.0)
        assert servicer.calls == 1
    finally:
        await remote.close()
        await server.stop(None)
