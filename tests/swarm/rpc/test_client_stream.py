"""A stream call that ends under its writer raises the status it ended with, as a failed call:
the half-close's `ExecuteBatchError` (grpc-aio's, when the call ended while it was on its way)
is what the suite caught on a trainer's forward to a replica SIGKILLed between steps, and it
killed the trainer as a bug (tests/system/test_faults.py, `idle-first`, one run in several)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc._cython import cygrpc

from swarm.errors import PeerUnavailable
from swarm.rpc import client_stream
from swarm.rpc.stage_client import StageClient
from swarm.wire.crossing import Crossing
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(30)


class _EndedCall:
    """A stream call (`client_stream.ClientStream`) that ended under its writer: its half-close
    fails as grpc-aio's does in that race, or its writes find it done; its status shows
    `status_after_s` later (None: never, until it is cancelled)."""

    def __init__(self, *, status_after_s: float | None, in_write: bool = False) -> None:
        self.status_after_s, self.in_write = status_after_s, in_write
        self.cancelled, self.written = False, 0

    async def write(self, request: Any) -> None:
        if self.in_write:
            raise asyncio.InvalidStateError("RPC already finished.")
        self.written += 1

    async def done_writing(self) -> None:
        raise cygrpc.ExecuteBatchError(
            'Failed "execute_batch": (<grpc._cython.cygrpc.SendCloseFromClientOperation>,)'
        )

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    async def code(self) -> grpc.StatusCode:
        if self.status_after_s is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(self.status_after_s or 0.0)
        return grpc.StatusCode.UNAVAILABLE

    async def details(self) -> str:
        return "Socket closed"

    async def initial_metadata(self) -> Any:
        return ()

    async def trailing_metadata(self) -> Any:
        return ()


async def test_a_half_close_that_fails_as_the_call_ends_raises_the_calls_status() -> None:
    call = _EndedCall(status_after_s=0.05)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await client_stream.done_writing(call)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert raised.value.details() == "Socket closed"
    assert not call.cancelled


async def test_a_write_to_an_ended_call_raises_the_calls_status() -> None:
    call = _EndedCall(status_after_s=0.0, in_write=True)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await client_stream.write(call, b"x")
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_call_that_shows_no_status_is_cancelled_and_reads_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(client_stream, "STATUS_GRACE_S", 0.1)
    call = _EndedCall(status_after_s=None)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await client_stream.done_writing(call)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "half-close failed" in (raised.value.details() or "")
    assert call.cancelled  # nothing left open behind the error


class _Stub:
    """The stage service's stub as far as a forward goes: its call has ended under it."""

    def __init__(self, call: _EndedCall) -> None:
        self.call = call

    def Forward(self, timeout: float | None = None) -> _EndedCall:  # the stub's method name
        return self.call


async def test_a_forward_whose_replica_died_under_its_half_close_is_a_peer_unavailable(
    tmp_path: Path,
) -> None:
    """The trainer's hop loop tries another replica on a `SwarmError`; anything else is a bug."""
    client = StageClient("127.0.0.1:9", make_job(tmp_path), "job", 0)
    call = _EndedCall(status_after_s=0.01)
    client.stub = _Stub(call)
    try:
        with pytest.raises(PeerUnavailable, match="UNAVAILABLE: Socket closed"):
            await client.forward(0, 1, Crossing(torch.zeros(2, 4, dtype=torch.long)))
        assert call.written >= 1  # it wrote its request, then the half-close failed
    finally:
        await client.close()
