"""Stand-ins several test files share."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import grpc

from swarm.bus.topics import Topics
from swarm.errors import ResourceExhausted, WireError
from swarm.proto import stage_pb2, stage_pb2_grpc
from swarm.wire.chunking import receive, split

__all__ = ["EchoStage", "NoBus", "SilentBus"]


class NoBus:
    """A bus for code paths that never publish: only `topics` exists, anything else fails loudly."""

    topics = Topics()


class SilentBus:
    """A bus that takes publications and whose subscriptions deliver nothing (no peers, no
    load reports): for a scheduler's job run with its replicas given otherwise."""

    topics = Topics()

    async def publish(self, topic: str, message: Any, retain: bool = False) -> None:
        pass

    async def subscribe(self, pattern: str) -> AsyncIterator[tuple[str, Any]]:
        await asyncio.Event().wait()
        yield "", None  # never reached: makes this an async generator


class EchoStage(stage_pb2_grpc.StageServiceServicer):
    """Forward replies with one (possibly chunked) request's tensors, as the data plane's bidi
    stream does; wire errors become status codes. `calls` counts the Forward calls handled."""

    calls: ClassVar[int] = 0

    def __init__(self, *, max_bytes: int = 1 << 30, chunk_bytes: int = 4 << 20) -> None:
        self.max_bytes = max_bytes
        self.chunk_bytes = chunk_bytes

    async def Forward(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[stage_pb2.StageForwardRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[stage_pb2.StageForwardResponse]:
        EchoStage.calls += 1
        try:
            got = await receive(request_iterator, max_bytes=self.max_bytes)
        except WireError as e:
            code = (
                grpc.StatusCode.RESOURCE_EXHAUSTED
                if isinstance(e, ResourceExhausted)
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            await context.abort(code, str(e))
        reply = stage_pb2.StageForwardResponse()
        for t, payload in zip(got.header.tensors, got.payloads, strict=True):
            out = reply.tensors.add()
            out.CopyFrom(t)
            out.data = bytes(payload)
        del got
        for m in split(reply, self.chunk_bytes):
            yield m
