"""Writing a client stream whose server may end it first: every write and the half-close of a
stream call this service makes go through `write` and `done_writing`, which raise the status the
call ended with, as a failed call's `grpc.RpcError`, wherever grpc-aio raises something else.

grpc-aio has two such places:
- a `write` after the call ended raises `asyncio.InvalidStateError`;
- a `done_writing` whose half-close core fails, because the call ended while it was on its way
  (the server died or refused, its connection was reset), raises cygrpc's `ExecuteBatchError`:
  grpc/grpc#24758 and #36066 for the same race on a write, which grpc-aio turns into an
  INTERNAL status itself. The suite caught it on a trainer's forward to a replica SIGKILLed
  between steps: not a `grpc.RpcError`, it passed every conversion to a swarm error, so the
  hop loop took it for a bug and the trainer died of it, where a dead replica is a try elsewhere.

Either way the status is read from the call, which has it or is about to (the stream is closed
under it): at most `STATUS_GRACE_S`. A call still open then is cancelled and reads as a peer that
did not answer (`UNAVAILABLE`), never as a hang: its half-close is lost, so it cannot end well.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import grpc
from grpc._cython import cygrpc  # where grpc-aio's own errors of core's batches live

from swarm.deadline import within

__all__ = ["STATUS_GRACE_S", "ClientStream", "done_writing", "write"]

STATUS_GRACE_S = 5.0
"""How long a call whose write or half-close failed may take to show the status it ended with."""


class ClientStream(Protocol):
    """What of a grpc-aio stream call (`StreamUnaryCall`, `StreamStreamCall`) this module uses."""

    async def write(self, request: Any) -> None: ...

    async def done_writing(self) -> None: ...

    def cancel(self) -> bool: ...

    async def code(self) -> grpc.StatusCode: ...

    async def details(self) -> str: ...

    async def initial_metadata(self) -> Any: ...

    async def trailing_metadata(self) -> Any: ...


async def write(call: ClientStream, message: Any) -> None:
    """`call.write(message)`; a stream the server already ended raises its status."""
    try:
        await call.write(message)
    except asyncio.InvalidStateError:
        raise await _ended(call, "a write") from None


async def done_writing(call: ClientStream) -> None:
    """`call.done_writing()`; a stream that ended under it raises its status."""
    try:
        await call.done_writing()
    except cygrpc.ExecuteBatchError:
        raise await _ended(call, "its half-close") from None


async def _ended(call: ClientStream, what: str) -> grpc.aio.AioRpcError:
    """The error of the status `call` ended with, once it has one (at most `STATUS_GRACE_S`)."""
    try:
        code = await within(call.code(), STATUS_GRACE_S)
    except TimeoutError:
        call.cancel()
        details = f"{what} failed and the call showed no status within {STATUS_GRACE_S:g}s"
        return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, (), (), details)
    return grpc.aio.AioRpcError(
        code, await call.initial_metadata(), await call.trailing_metadata(), await call.details()
    )
