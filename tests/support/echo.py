"""A real gRPC round trip for the chunked wire: `EchoStage` (`tests.support.fakes`) on a server in
this process (`stub`), and `echo`, which streams a request's parts through it and reads the reply
while the request side stays open, as the data plane's bidi stream does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import grpc
import pytest

from swarm.proto import stage_pb2, stage_pb2_grpc
from swarm.wire.chunking import Received, receive
from tests.support.fakes import EchoStage

__all__ = ["CHUNK_BYTES", "GRPC_MAX_MESSAGE", "LIMIT", "OPTIONS", "MiB", "echo", "stub"]

MiB = 1 << 20
GRPC_MAX_MESSAGE = 64 * MiB
CHUNK_BYTES = 4 * MiB
LIMIT = 1 << 30
OPTIONS = [
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE),
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE),
]


@pytest.fixture
async def stub() -> AsyncIterator[stage_pb2_grpc.StageServiceStub]:
    server = grpc.aio.server(options=OPTIONS)
    echo_stage = EchoStage(max_bytes=LIMIT, chunk_bytes=CHUNK_BYTES)
    stage_pb2_grpc.add_StageServiceServicer_to_server(echo_stage, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as channel:
            yield stage_pb2_grpc.StageServiceStub(channel)
    finally:
        await server.stop(grace=None)


async def echo(
    stub: stage_pb2_grpc.StageServiceStub, parts: Iterable[stage_pb2.StageForwardRequest]
) -> Received[stage_pb2.StageForwardResponse]:
    call = stub.Forward(timeout=120)

    async def send() -> None:
        for m in parts:
            await call.write(m)

    sender = asyncio.create_task(send())
    # The request side stays open while the reply is read: neither end waits for end-of-stream.
    got = await receive(call, max_bytes=LIMIT)
    await sender
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK
    return got
