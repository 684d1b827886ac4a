"""The one error mapping every servicer shares (`swarm.rpc.servicing`): a swarm error is refused
with
its status and the metadata naming its class, a bug is INTERNAL, every call is observed; and over a
real stage server, a client rebuilds `ActivationsNotCached` exactly from the trailing metadata."""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from stage_server.server import StageServerOptions, start_stage_server
from swarm.errors import ActivationsNotCached, InvalidArgument, NotFound, WireError
from swarm.job.fingerprint import fingerprint
from swarm.net.told_ahead import TOLD_CODE_KEY, TOLD_DETAILS_KEY
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc
from swarm.rpc.servicing import Servicing
from swarm.rpc.status import ERROR_KEY, from_rpc_error
from swarm.wire import codec
from tests.support.jobs import make_job


class Aborted(Exception):
    """What the fake context's `abort` raises, as grpc.aio's does."""


class FakeContext:
    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]] | None = None
        self.initial: tuple[tuple[str, str | bytes], ...] | None = None

    async def send_initial_metadata(self, metadata: Sequence[Any]) -> None:
        if self.initial is not None:
            raise grpc.aio.UsageError("Send initial metadata failed: already sent")
        self.initial = tuple(metadata)

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Sequence[Any] = ()
    ) -> None:
        self.aborted = (code, details, tuple(trailing_metadata))
        raise Aborted


def _servicing() -> tuple[Servicing, list[tuple[str, str]]]:
    seen: list[tuple[str, str]] = []
    return Servicing("test", lambda method, code, s: seen.append((method, code))), seen


async def test_a_swarm_error_is_refused_with_its_status_and_class() -> None:
    serving, seen = _servicing()
    context = FakeContext()

    async def body() -> None:
        raise NotFound("unknown job 'x'")

    with pytest.raises(Aborted):
        await serving.run("GetJob", context, body)  # type: ignore[arg-type]
    assert context.aborted == (
        grpc.StatusCode.NOT_FOUND,
        "unknown job 'x'",
        ((ERROR_KEY, "NotFound"),),
    )
    assert seen == [("GetJob", "NOT_FOUND")]
    # told ahead too, for a client whose write raced the end (`swarm.net.told_ahead`)
    assert context.initial == (
        (TOLD_CODE_KEY, "NOT_FOUND"),
        (TOLD_DETAILS_KEY, b"unknown job 'x'"),
        (ERROR_KEY, "NotFound"),
    )


async def test_a_wire_error_of_no_kind_is_invalid_argument() -> None:
    serving, _ = _servicing()
    context = FakeContext()

    async def body() -> None:
        raise WireError("odd")

    with pytest.raises(Aborted):
        await serving.run("Forward", context, body)  # type: ignore[arg-type]
    assert context.aborted is not None and context.aborted[0] == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_bug_is_internal_and_logged_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    serving, seen = _servicing()
    context = FakeContext()

    async def body() -> None:
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, "swarm.rpc.servicing"), pytest.raises(Aborted):
        await serving.run("Commit", context, body)  # type: ignore[arg-type]
    assert context.aborted == (grpc.StatusCode.INTERNAL, "RuntimeError: boom", ())
    assert seen == [("Commit", "INTERNAL")]
    assert any(r.exc_info is not None for r in caplog.records)


class Held:
    """What a handler's frame holds (a stage's runtime, say)."""


@pytest.mark.parametrize("kind", ["run", "stream"])
async def test_a_refused_call_lets_go_of_the_frames_its_error_was_raised_through(
    kind: str,
) -> None:
    """grpc.aio keeps the abort's exception on the call's state, which the frames in the abort's
    traceback hold through the context: a cycle only the collector frees. The error is let go
    of its traceback (and is not the abort's implicit context), so what its frames held goes at
    once: a stage's runtime held by a Push refused after a move outlived the move (the soak).
    The collector is off: on the old code the frame's `held` lived on."""
    serving, _ = _servicing()
    context = FakeContext()
    raised: list[BaseException] = []
    made: list[weakref.ref[Held]] = []

    def hold() -> Held:
        held = Held()
        made.append(weakref.ref(held))
        return held

    async def refused(held: Held) -> None:
        try:
            raise OSError("the next hop's link")
        except OSError as e:
            error = NotFound(f"no replica took it ({held})")
            raised.append(error)
            raise error from e

    async def body() -> None:
        await refused(hold())

    async def streamed() -> AsyncIterator[int]:
        yield 1
        await refused(hold())

    gc.collect()
    gc.disable()
    try:
        with pytest.raises(Aborted) as aborted:
            if kind == "run":
                await serving.run("Push", context, body)  # type: ignore[arg-type]
            else:
                async for _ in serving.stream("Export", context, streamed()):  # type: ignore[arg-type]
                    pass
        assert aborted.value.__context__ is None
        (error,) = raised
        assert error.__traceback__ is None and error.__cause__ is not None
        assert error.__cause__.__traceback__ is None
        (held,) = made
        assert held() is None, "a frame it was raised through still holds it"
    finally:
        gc.enable()


async def test_success_is_observed_and_returned() -> None:
    serving, seen = _servicing()

    async def body() -> int:
        return 7

    assert await serving.run("Info", FakeContext(), body) == 7  # type: ignore[arg-type]
    assert seen == [("Info", "OK")]


async def test_a_stream_that_fails_midway_ends_with_the_status() -> None:
    serving, seen = _servicing()
    context = FakeContext()

    async def body() -> AsyncIterator[int]:
        yield 1
        raise InvalidArgument("bad second part")

    got: list[int] = []
    with pytest.raises(Aborted):
        async for x in serving.stream("ExportModel", context, body()):  # type: ignore[arg-type]
            got.append(x)
            context.initial = ()  # the first message sent the initial metadata
    assert got == [1]
    assert context.aborted is not None and context.aborted[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert seen == [("ExportModel", "INVALID_ARGUMENT")]


async def test_activations_not_cached_reaches_a_grpc_client_as_itself(tmp_path: Path) -> None:
    job = make_job(tmp_path, training={"stages": 3})
    running = await start_stage_server(job, StageServerOptions(stage=1, metrics_port=0))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = stage_pb2_grpc.StageServiceStub(channel)
            grad = codec.encode(torch.ones(4, 16, 32), "grad_outputs")
            request = pb.StageBackwardRequest(  # no inputs, and no forward ran here
                job=fingerprint(job),
                stage=1,
                microbatch=pb.MicrobatchId(step=0, index=3),
                tensors=[grad],
            )
            call: Any = stub.Backward(timeout=30)
            await call.write(request)
            await call.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                _ = [r async for r in call]
    finally:
        await running.stop()
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (ERROR_KEY, "ActivationsNotCached") in tuple(info.value.trailing_metadata() or ())
    error = from_rpc_error(info.value)
    assert type(error) is ActivationsNotCached
