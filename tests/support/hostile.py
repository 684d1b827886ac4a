"""A hostile member of a stage as a real gRPC server: it answers DownloadState and Updates with
whatever its test gives it (an endless or oversized state, a tensor of the wrong shape, a stream of
updates that never ends), one tensor a message (or `per_message` state tensors), chunked, as a real
replica sends them (or trickled: `pause_s` after each chunk), and counts the tensor bytes it wrote,
so a test can tell how far a receiver read before it cancelled the call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import torch

from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc
from swarm.wire import chunking as wire
from swarm.wire import codec

__all__ = ["HostileStage", "serving"]

# (name, tensor) of a state, one message each
StateReply = Callable[[], Iterable[tuple[str, torch.Tensor]]]
# (step, index, gradient sum) of the updates from a step on, one message each
UpdatesReply = Callable[[int], Iterable[tuple[int, int, torch.Tensor]]]


def _none(*_: object) -> Iterator[tuple[int, int, torch.Tensor]]:
    return iter(())


class HostileStage(stage_pb2_grpc.StageServiceServicer):
    """Answers DownloadState with `state()` at `step` and Updates with `updates(from_step)`,
    in messages of at most `chunk_bytes`. `sent`: the tensor bytes written so far; `ended` is
    set once a stream ended, having written all it offered or not (`cut`: its receiver
    cancelled it)."""

    def __init__(
        self,
        state: StateReply = lambda: (),
        step: int = 0,
        updates: UpdatesReply = _none,
        chunk_bytes: int = 64 << 10,
        per_message: int = 1,
        pause_s: float = 0.0,
    ) -> None:
        self.state, self.step, self.updates, self.chunk_bytes = state, step, updates, chunk_bytes
        self.per_message = per_message  # state tensors a DownloadState message carries
        self.pause_s = pause_s  # after each chunk of a DownloadState
        self.sent = 0
        self.ended = asyncio.Event()
        self.cut = False

    def _end(self, done: bool) -> None:
        self.cut = not done
        self.ended.set()

    def _parts(self, message: Any) -> Iterator[Any]:
        for part in wire.split(message, self.chunk_bytes):
            self.sent += len(part.chunk.data) + sum(len(t.data) for t in part.tensors)
            yield part

    async def DownloadState(  # type: ignore[override]
        self, request: pb.StageDownloadStateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StageDownloadStateResponse]:
        done = False  # a cancel closes this generator (or cancels it) at a yield
        try:
            batch: list[Any] = []
            for name, tensor in self.state():
                batch.append(codec.encode(tensor, name))
                if len(batch) < self.per_message:
                    continue
                reply = pb.StageDownloadStateResponse(tensors=batch, step=self.step)
                batch = []
                for part in self._parts(reply):
                    yield part
                    await asyncio.sleep(self.pause_s)
            if batch:
                for part in self._parts(
                    pb.StageDownloadStateResponse(tensors=batch, step=self.step)
                ):
                    yield part
            done = True
        finally:
            self._end(done)

    async def Updates(  # type: ignore[override]
        self, request: pb.StageUpdatesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StageUpdatesResponse]:
        done = False
        try:
            for step, index, tensor in self.updates(request.from_step):
                reply = pb.StageUpdatesResponse(
                    tensors=[codec.encode(tensor, str(index))],
                    step=step,
                    total_samples=4,
                    grad_scale=1.0,
                )
                for part in self._parts(reply):
                    yield part
            done = True
        finally:
            self._end(done)


@asynccontextmanager
async def serving(servicer: stage_pb2_grpc.StageServiceServicer) -> AsyncIterator[str]:
    """`servicer` on a free port of 127.0.0.1 (in clear text, no token); yields its address."""
    server = grpc.aio.server()
    stage_pb2_grpc.add_StageServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
