"""The stage client's boundary and the coordinator's cache of connections: a call whose channel
is closed under it is a peer that did not answer (never a cancellation of the caller), and
connections of replicas that left are closed only once their calls in flight had their time. A
state download and a follower's updates take no more than the stage's state (or the update log)
can hold, and only tensors the stage would load: a hostile member is cut off where it passes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from scheduler.coordinator.replicas import ReplicaClients
from swarm.errors import FailedPrecondition, InvalidArgument, PeerUnavailable, ResourceExhausted
from swarm.job.config import JobConfig
from swarm.model.stage_state import initial_state
from swarm.model.state_checks import StateChecks
from swarm.model.transformer import build_stage
from swarm.proto import stage_pb2, stage_pb2_grpc
from swarm.rpc import late_audit
from swarm.rpc.lease import Replica
from swarm.rpc.stage_client import StageClient
from swarm.wire import codec
from swarm.wire.crossing import Crossing
from tests.support.hostile import HostileStage, serving
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


async def test_a_closed_channel_is_a_peer_unavailable_in_a_cleanup_after_a_cancel(
    tmp_path: Path,
) -> None:
    """A task that handled a cancellation and now cleans up (asking a replica on its way out):
    a channel closed under that call is a peer that did not answer, as anywhere else. The
    boundary read any cancellation under way as the caller's own (a review found it)."""
    server = grpc.aio.server()
    stage_pb2_grpc.add_StageServiceServicer_to_server(_Hung(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = StageClient(f"127.0.0.1:{port}", make_job(tmp_path), "job", 0)
    asking = asyncio.Event()

    async def cancelled_then_asks() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            asking.set()  # handled: its cleanup asks the replica
            try:
                await client.info()
            except PeerUnavailable as e:
                return f"unavailable: {e}"
        return "answered"

    try:
        task = asyncio.create_task(cancelled_then_asks())
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait_for(asking.wait(), 5)
        await asyncio.sleep(0.3)  # in flight
        await client.close()
        await asyncio.wait([task], timeout=5)
        assert task.done() and not task.cancelled()
        assert task.result().startswith("unavailable: "), task.result()
    finally:
        await server.stop(None)


class _Trickle(stage_pb2_grpc.StageServiceServicer):
    """DownloadState sends one small tensor of `state` every `pause_s`, `count` times, then (if
    `stall`) nothing more: a large state over a slow link, or a replica that froze mid-transfer."""

    def __init__(
        self, state: dict[str, torch.Tensor], count: int, pause_s: float, stall: bool
    ) -> None:
        self.state, self.count, self.pause_s, self.stall = state, count, pause_s, stall

    async def DownloadState(  # type: ignore[override]
        self, request: stage_pb2.StageDownloadStateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[stage_pb2.StageDownloadStateResponse]:
        for name, value in list(self.state.items())[: self.count]:
            await asyncio.sleep(self.pause_s)
            tensor = codec.encode(value, name)
            yield stage_pb2.StageDownloadStateResponse(tensors=[tensor], step=7)
        if self.stall:
            await asyncio.sleep(3600)


@pytest.mark.parametrize("stall", [False, True])
async def test_a_state_download_lasts_while_bytes_come_and_fails_when_they_stop(
    tmp_path: Path, stall: bool
) -> None:
    job = make_job(tmp_path, runtime={"rpc_timeout_s": 0.8, "commit_timeout_s": 1.0})
    whole = initial_state(job, 1)  # 12 parameters
    count = 6 if stall else len(whole)
    server = grpc.aio.server()
    stage_pb2_grpc.add_StageServiceServicer_to_server(_Trickle(whole, count, 0.15, stall), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = StageClient(f"127.0.0.1:{port}", job, "job", 1)
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        if stall:
            with pytest.raises(PeerUnavailable, match=r"no bytes for 0\.8s"):
                await client.download_state(expect=StateChecks(job, 1))
            assert loop.time() - started < 6 * 0.15 + 3 * 0.8  # soon after the bytes stopped
        else:
            # Longer than either deadline in all: each message came in time, so it ends.
            step, state = await client.download_state(expect=StateChecks(job, 1))
            assert step == 7 and sorted(state) == sorted(k.removeprefix("param/") for k in whole)
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


# -- a hostile member: what a state download and the updates may hold -------------------------
STAGE = 1  # of the tiny job: one transformer block, 12 parameters
FLOOD = 64 << 20  # what a hostile member offers: many times what the stage's state can take
# What gRPC's flow control lets a sender write ahead of a receiver that reads no more (HTTP/2
# windows and socket buffers: a few MiB on loopback), whatever the stream's length.
IN_FLIGHT = 16 << 20


def _stage_params(job: JobConfig) -> list[torch.Tensor]:
    return [p.detach() for p in build_stage(job, STAGE).parameters()]


def _endless_optimizer_state(job: JobConfig) -> Callable[[], Iterator[tuple[str, torch.Tensor]]]:
    """Optimizer state of the right sizes under ever new keys, `FLOOD` bytes of it: each tensor
    alone is one the stage's state could hold."""

    def state() -> Iterator[tuple[str, torch.Tensor]]:
        sent = key = 0
        while sent < FLOOD:
            for i, p in enumerate(_stage_params(job)):
                yield f"optim/{i}/k{key}", torch.zeros_like(p)
                sent += p.nbytes
            key += 1

    return state


def _one_huge_tensor(job: JobConfig) -> Callable[[], Iterator[tuple[str, torch.Tensor]]]:
    """A parameter's name declaring `FLOOD` bytes: refused from its header, before its chunks."""
    name = next(iter(build_stage(job, STAGE).state_dict()))
    return lambda: iter([(f"param/{name}", torch.zeros(FLOOD // 8, dtype=torch.float64))])


async def _ended(fake: HostileStage) -> None:
    """The hostile stream ended: the receiver cancelled it (it offered more than was read)."""
    await asyncio.wait_for(fake.ended.wait(), 10)
    assert fake.cut


@pytest.mark.parametrize("offer", [_endless_optimizer_state, _one_huge_tensor])
async def test_a_state_download_stops_at_the_stages_bound_and_cancels_the_sender(
    tmp_path: Path, offer: Callable[[JobConfig], Callable[[], Iterator[tuple[str, torch.Tensor]]]]
) -> None:
    job = make_job(tmp_path)
    expect = StateChecks(job, STAGE)
    bound = expect.max_state_bytes()  # about 1.4 MiB here
    fake = HostileStage(offer(job), step=3)
    # Ever new optimizer keys are refused at the first, which the job's optimizer lacks.
    error, refusal = (
        (InvalidArgument, r"no key 'k0'")
        if offer is _endless_optimizer_state
        else (ResourceExhausted, rf"at most {bound} in all")
    )
    async with serving(fake) as address:
        client = StageClient(address, job, "job", STAGE)
        try:
            with pytest.raises(error, match=rf"at {address} .*{refusal}"):
                await client.download_state(True, prefix="", expect=expect)
            await _ended(fake)
        finally:
            await client.close()
    # What it wrote before the cancel: the bound, and what the transport buffered ahead.
    assert fake.sent < bound + IN_FLIGHT < FLOOD


def _wrong_shape(name: str, value: torch.Tensor) -> tuple[str, torch.Tensor]:
    return name, torch.zeros(3, dtype=value.dtype)


def _wrong_dtype(name: str, value: torch.Tensor) -> tuple[str, torch.Tensor]:
    return name, value.float()


def _unknown_name(name: str, value: torch.Tensor) -> tuple[str, torch.Tensor]:
    return "param/layers.9.mystery", value


@pytest.mark.parametrize(
    ("spoil", "refusal"),
    [
        (_wrong_shape, r"must be torch\.float64 \[32\]; got torch\.float64 \[3\]"),
        (_wrong_dtype, r"must be torch\.float64 \[32\]; got torch\.float32 \[32\]"),
        (_unknown_name, r"has no parameter 'param/layers\.9\.mystery'"),
        (None, r"lacks 1 parameters: param/layers\.1\.ln1\.weight"),
    ],
)
async def test_a_state_download_refuses_a_tensor_the_stage_would_not_load(
    tmp_path: Path,
    spoil: Callable[[str, torch.Tensor], tuple[str, torch.Tensor]] | None,
    refusal: str,
) -> None:
    """Its first tensor spoiled (or left out): refused as LoadState would, naming the sender."""
    job = make_job(tmp_path)
    whole = list(initial_state(job, STAGE).items())
    first = [spoil(*whole[0])] if spoil is not None else []
    fake = HostileStage(lambda: first + whole[1:], step=3)
    async with serving(fake) as address:
        client = StageClient(address, job, "job", STAGE)
        try:
            with pytest.raises(InvalidArgument, match=rf"replica at {address} sent .*{refusal}"):
                await client.download_state(True, prefix="", expect=StateChecks(job, STAGE))
        finally:
            await client.close()


def _endless_updates(job: JobConfig) -> Callable[[int], Iterator[tuple[int, int, torch.Tensor]]]:
    def updates(from_step: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        sent, step = 0, from_step
        while sent < FLOOD:
            for i, p in enumerate(_stage_params(job)):
                yield step, i, torch.zeros_like(p)
                sent += p.nbytes
            step += 1

    return updates


async def test_updates_stop_at_the_update_logs_bound_and_cancel_the_sender(
    tmp_path: Path,
) -> None:
    job = make_job(tmp_path, runtime={"update_log_bytes": 1 << 20})
    expect = StateChecks(job, STAGE)
    bound = 1 << 20  # what the update log keeps: more than one update here
    assert expect.max_update_bytes() < bound
    fake = HostileStage(updates=_endless_updates(job))
    async with serving(fake) as address:
        client = StageClient(address, job, "job", STAGE)
        try:
            with pytest.raises(ResourceExhausted, match=rf"at most {bound} in all: .*update_log"):
                await client.updates("me", 5, expect=expect)
            await _ended(fake)
        finally:
            await client.close()
    assert fake.sent < bound + IN_FLIGHT < FLOOD


async def test_updates_refuse_a_gradient_sum_of_the_wrong_shape(tmp_path: Path) -> None:
    job = make_job(tmp_path)

    def updates(from_step: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        for i, p in enumerate(_stage_params(job)):
            yield from_step, i, torch.zeros(7, dtype=p.dtype) if i == 2 else torch.zeros_like(p)

    fake = HostileStage(updates=updates)
    async with serving(fake) as address:
        client = StageClient(address, job, "job", STAGE)
        try:
            with pytest.raises(
                InvalidArgument, match=rf"at {address} sent .*: gradient sum 2 must be .* \[7\]"
            ):
                await client.updates("me", 5, expect=StateChecks(job, STAGE))
        finally:
            await client.close()


def _tiny_optimizer_keys(job: JobConfig, count: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The stage's real state, then `count` one-byte scalars under ever new optimizer keys: each
    alone the size of a step counter (the review's repro, issue 27: 300,000 in one message)."""
    yield from initial_state(job, STAGE).items()
    for i in range(count):
        yield f"optim/0/k{i}", torch.zeros((), dtype=torch.uint8)


@pytest.mark.parametrize("per_message", [5_000, 1])
async def test_a_state_of_many_tiny_tensors_is_refused(tmp_path: Path, per_message: int) -> None:
    # 5,000 one-byte tensors: 5 KB of payload, far below the stage's bound, but each one a
    # torch tensor (hundreds of bytes) on the receiver. In one message: refused from its header
    # (too many tensors a message); one a message: refused at the first key no optimizer has.
    job = make_job(tmp_path)
    fake = HostileStage(lambda: _tiny_optimizer_keys(job, 5_000), step=3, per_message=per_message)
    refusal = (
        r"5000 tensors, more than 64 a message"
        if per_message > 1
        else r"'optim/0/k0' .* no key 'k0'"
    )
    async with serving(fake) as address:
        client = StageClient(address, job, "job", STAGE)
        try:
            with pytest.raises(InvalidArgument, match=rf"at {address} .*{refusal}"):
                await client.download_state(True, prefix="", expect=StateChecks(job, STAGE))
        finally:
            await client.close()


class _Heard(stage_pb2_grpc.StageServiceServicer):
    """Notes whether each Forward, Backward or ForwardBackward said it was a late audit's, then
    refuses it (the answer is not what is tested)."""

    def __init__(self) -> None:
        self.late: list[tuple[str, bool]] = []

    async def _heard(self, call: str, requests: AsyncIterator[Any], context: Any) -> None:
        async for header in requests:
            self.late.append((call, header.late))
            break
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "noted")

    async def Forward(self, request_iterator: Any, context: Any) -> Any:  # type: ignore[override]
        await self._heard("forward", request_iterator, context)

    async def Backward(self, request_iterator: Any, context: Any) -> Any:  # type: ignore[override]
        await self._heard("backward", request_iterator, context)

    async def ForwardBackward(  # type: ignore[override]
        self, request_iterator: Any, context: Any
    ) -> Any:
        await self._heard("forward_backward", request_iterator, context)


async def test_a_late_audits_reexecutions_say_so_on_the_wire(tmp_path: Path) -> None:
    """A call made in a late audit's task (`swarm.rpc.late_audit`) carries `late`, so its
    auditor runs it in turn with the pushes (`stage_server.replica.answering`); any other
    carries none, and is run ahead there where it re-executes."""
    heard = _Heard()
    x = torch.ones(2, 4)

    async def calls(client: StageClient) -> None:
        for call in (
            client.forward(0, 1, Crossing(x)),
            client.backward(0, 1, None, x, accumulate=False),
            client.forward_backward(0, 1, Crossing(x), x, accumulate=False),
        ):
            with pytest.raises(FailedPrecondition):
                await call

    async def late() -> None:
        late_audit.in_late_audit()
        await calls(client)

    async with serving(heard) as address:
        client = StageClient(address, make_job(tmp_path), "job", 0)
        try:
            await calls(client)
            await asyncio.create_task(late())
            await calls(client)  # the mark stayed in the late audit's task
        finally:
            await client.close()
    names = ["forward", "backward", "forward_backward"]
    assert heard.late == [
        *((n, False) for n in names),
        *((n, True) for n in names),
        *((n, False) for n in names),
    ]
