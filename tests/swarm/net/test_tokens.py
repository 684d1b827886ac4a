"""Swarm tokens on a real grpc.aio server: every call kind is refused without the right token,
allowed with it; the health service stays open; refusals are counted."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.sdk import ClientError, SchedulerClient
from swarm.net import dial
from swarm.net import tokens as auth
from swarm.proto import scheduler_pb2, scheduler_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.support.api import RunningApi, start_api
from tests.support.fakes import EchoStage
from tests.support.jobs import write_job

TOKEN = "s3cret-token"


async def _uu(request: bytes, context: Any) -> bytes:
    return request


async def _us(request: bytes, context: Any) -> AsyncIterator[bytes]:
    yield request
    yield request


async def _su(requests: AsyncIterator[bytes], context: Any) -> bytes:
    return b"".join([r async for r in requests])


async def _ss(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    async for r in requests:
        yield r


def _more(server: grpc.aio.Server) -> None:
    stage_pb2_grpc.add_StageServiceServicer_to_server(EchoStage(), server)
    raw = grpc.method_handlers_generic_handler(
        "test.Raw",
        {
            "UU": grpc.unary_unary_rpc_method_handler(_uu),
            "US": grpc.unary_stream_rpc_method_handler(_us),
            "SU": grpc.stream_unary_rpc_method_handler(_su),
            "SS": grpc.stream_stream_rpc_method_handler(_ss),
        },
    )
    server.add_generic_rpc_handlers((raw,))


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[RunningApi]:
    EchoStage.calls = 0  # shared by every EchoStage: count this test's calls only
    running = await start_api(tmp_path, token=TOKEN, more=_more)
    yield running
    await running.stop()


async def _bytes() -> AsyncIterator[bytes]:
    for part in (b"ab", b"cd"):
        yield part


async def _every_kind(channel: grpc.aio.Channel) -> list[Any]:
    """One call of each kind; returns their results (raises AioRpcError on refusal)."""
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    listed = await stub.ListJobs(scheduler_pb2.SchedulerListJobsRequest(), timeout=5)
    # Bidi through the write API, as the trainer's StageClient drives it.
    call = stage_pb2_grpc.StageServiceStub(channel).Forward(timeout=5)
    await call.write(stage_pb2.StageForwardRequest(job="j", stage=0))
    echoed = await call.read()
    await call.done_writing()
    uu = await channel.unary_unary("/test.Raw/UU")(b"x", timeout=5)
    us = [m async for m in channel.unary_stream("/test.Raw/US")(b"y", timeout=5)]
    su = await channel.stream_unary("/test.Raw/SU")(_bytes(), timeout=5)
    ss = [m async for m in channel.stream_stream("/test.Raw/SS")(_bytes(), timeout=5)]
    return [list(listed.jobs), echoed.tensors, uu, us, su, ss]


def _refused(api: RunningApi) -> float:
    value = api.registry.get_sample_value("swarm_auth_refused_total")
    return value or 0.0


@pytest.mark.parametrize("token", [None, "wrong-token", ""], ids=["none", "wrong", "empty"])
async def test_refused_without_the_token(api: RunningApi, token: str | None) -> None:
    async with dial.channel(api.address, token=token) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.ListJobs(scheduler_pb2.SchedulerListJobsRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The bidi data-plane shape: refused before the handler reads anything.
        call = stage_pb2_grpc.StageServiceStub(channel).Forward(timeout=5)
        await call.write(stage_pb2.StageForwardRequest(job="j", stage=0))
        assert await call.code() == grpc.StatusCode.UNAUTHENTICATED
        kinds = [
            ("UU", channel.unary_unary, b"x"),
            ("US", channel.unary_stream, b"x"),
            ("SU", channel.stream_unary, _bytes()),
            ("SS", channel.stream_stream, _bytes()),
        ]
        for method, kind, request in kinds:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _consume(kind(f"/test.Raw/{method}")(request, timeout=5))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _refused(api) == 6 and EchoStage.calls == 0


async def _consume(call: Any) -> Any:
    if hasattr(call, "__aiter__"):
        return [m async for m in call]
    return await call


async def test_wrong_scheme_refused(api: RunningApi) -> None:
    async with grpc.aio.insecure_channel(api.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        for value in (f"Basic {TOKEN}", TOKEN, f"Bearer {TOKEN}x"):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.ListJobs(
                    scheduler_pb2.SchedulerListJobsRequest(),
                    metadata=(("authorization", value),),
                    timeout=5,
                )
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The scheme is case-insensitive (RFC 6750).
        ok = await stub.ListJobs(
            scheduler_pb2.SchedulerListJobsRequest(),
            metadata=(("authorization", f"bearer {TOKEN}"),),
            timeout=5,
        )
        assert list(ok.jobs) == []
    assert _refused(api) == 3


async def test_every_kind_allowed_with_the_token(api: RunningApi) -> None:
    async with dial.channel(api.address, token=TOKEN) as channel:
        listed, echoed, uu, us, su, ss = await _every_kind(channel)
    assert listed == [] and len(echoed) == 0
    assert (uu, us, su, ss) == (b"x", [b"y", b"y"], b"abcd", [b"ab", b"cd"])
    assert _refused(api) == 0


async def test_client_sdk_with_token(api: RunningApi, tmp_path: Path) -> None:
    async with SchedulerClient(api.address, token=TOKEN) as client:
        job = (await client.submit(write_job(tmp_path, "authed"))).job
        assert await client.export(job, tmp_path / "m.pt") == 7  # a server stream
    async with SchedulerClient(api.address) as client:
        with pytest.raises(ClientError, match="refused the call: no authorization") as e:
            await client.list()
    assert e.value.code == "UNAUTHENTICATED"


async def test_health_needs_no_token(api: RunningApi) -> None:
    async with grpc.aio.insecure_channel(api.address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert _refused(api) == 0


def test_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    from prometheus_client import CollectorRegistry

    from swarm.ops.rated import RatedLog

    refusals = RatedLog(logging.getLogger("test"))
    assert auth.server_interceptors(None, CollectorRegistry(), refusals) == []
    assert len(auth.server_interceptors("t", CollectorRegistry(), refusals)) == 1
    monkeypatch.setenv("SWARM_TOKEN", " abc \n")
    assert auth.token_from_env() == "abc"
    monkeypatch.setenv("SWARM_TOKEN", "  ")
    assert auth.token_from_env() is None
    monkeypatch.delenv("SWARM_TOKEN")
    assert auth.token_from_env() is None
