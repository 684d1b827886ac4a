"""A connection to one stage server: chunked bidi calls with a deadline on each. Every public call
raises `swarm.errors` (via `swarm.rpc.status.from_rpc_error`), never a gRPC error: callers catch
`PeerUnavailable`, `NotFound`, `Aborted`, `ActivationsNotCached`, ... and read no status details."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Coroutine,
    Iterable,
    Sequence,
)
from dataclasses import dataclass, field
from typing import Any, NamedTuple, ParamSpec, Protocol, TypeVar

import grpc
import torch

from swarm.errors import InvalidArgument, PeerUnavailable, ResourceExhausted
from swarm.job.config import JobConfig
from swarm.job.rule import rule_of
from swarm.net import tokens as auth
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc, tensor_pb2
from swarm.rpc.status import from_rpc_error
from swarm.wire import chunking as wire
from swarm.wire import codec
from swarm.wire.chunking import grpc_options
from swarm.wire.codec import CODEC_NONE

__all__ = [
    "BackwardResult",
    "ExpectedState",
    "PushResult",
    "StageClient",
    "StateSink",
    "TensorLike",
    "as_tensor",
    "named",
]

P = ParamSpec("P")
R = TypeVar("R")


def _swarm_errors(call: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """The boundary: a failed call (unary or streaming, at any point of the stream) raises the
    swarm error its status means, chained to the gRPC error for the logs."""

    @functools.wraps(call)
    async def converted(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await call(*args, **kwargs)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our caller was cancelled
            # The channel was closed under the call (a client replaced or closed): to the
            # caller that is a peer that did not answer, not a cancellation of its own task.
            raise PeerUnavailable("the connection was closed during the call") from None

    return converted


async def _write(call: Any, message: Any) -> None:
    """`call.write`, where a stream the server already ended (it refused the request, or it
    died) raises the status the server ended it with."""
    try:
        await call.write(message)
    except asyncio.InvalidStateError:
        code = await call.code()
        raise grpc.aio.AioRpcError(
            code,
            await call.initial_metadata(),
            await call.trailing_metadata(),
            await call.details(),
        ) from None


# A tensor on the trainer's side: a torch tensor to encode, or a message received from another
# stage and passed on as it is (the trainer never decodes activations or gradients).
TensorLike = torch.Tensor | tensor_pb2.Tensor


@dataclass(frozen=True)
class BackwardResult:
    grad_inputs: tensor_pb2.Tensor | None
    receipt: pb.Receipt
    loss_sum: float = 0.0
    queued_seconds: float = 0.0  # how long the call waited behind others at the replica


@dataclass(frozen=True)
class PushResult:
    grad_inputs: tensor_pb2.Tensor | None
    receipts: list[pb.Receipt]  # of every stage that accumulated the microbatch
    uncertain: set[int]  # stages that may have accumulated it without a receipt here
    loss_sum: float
    queued_seconds: float
    path: list[str] = field(default_factory=list)  # the replicas of the later stages


def as_tensor(value: TensorLike) -> torch.Tensor:
    """Decode a received tensor message (tests and tools; the trainer has no need)."""
    return value if isinstance(value, torch.Tensor) else codec.decode(value)


class StageClient:
    def __init__(
        self, address: str, job: JobConfig, job_id: str, stage: int, token: str | None = None
    ) -> None:
        self.address, self.job, self.job_id, self.stage = address, job, job_id, stage
        rt = job.runtime
        self._timeout, self._chunk, self._max = (
            rt.rpc_timeout_s,
            rt.chunk_bytes,
            rt.max_tensor_bytes,
        )
        # Any: the generated stubs type enum fields as their enum class, not int.
        # Activations (inputs, outputs) go with the forward codec, their gradients with the
        # backward one: a stage's replies are encoded as asked (`reply_codec`).
        self._forward: Any = codec.codec_from_name(job.compression.forward)
        self._backward: Any = codec.codec_from_name(job.compression.backward)
        self._block = job.compression.block_size
        self.channel = auth.channel(
            address, token=token, options=grpc_options(rt.max_message_bytes)
        )
        self.stub = stage_pb2_grpc.StageServiceStub(self.channel)
        self.last_queued_s = 0.0

    async def close(self) -> None:
        await self.channel.close()

    def _tensor(self, t: TensorLike, name: str, with_codec: int) -> tensor_pb2.Tensor:
        if isinstance(t, tensor_pb2.Tensor):
            t.name = name  # a received message is ours to relabel; its bytes go on untouched
            return t
        return codec.encode(t, name, with_codec, self._block)

    async def _call(
        self, method: Any, request: Any, timeout: float | None = None
    ) -> tuple[Any, dict[str, tensor_pb2.Tensor]]:
        call = method(timeout=self._timeout if timeout is None else timeout)
        for msg in wire.split(request, self._chunk):
            await _write(call, msg)
        await call.done_writing()
        received: wire.Received[Any] = await wire.receive_reply(call, max_bytes=self._max)
        tensors = {}
        for t, payload in zip(received.header.tensors, received.payloads, strict=True):
            codec.decoded_nbytes(t)  # validate the header before passing it on
            if len(t.data) != t.nbytes:  # it came in chunks: put the bytes back in one message
                t.data = bytes(payload)
            tensors[t.name] = t
        return received.header, tensors

    def _inputs_and_targets(
        self, inputs: TensorLike, targets: TensorLike
    ) -> list[tensor_pb2.Tensor]:
        """The last stage's (or a push's) tensors: activations in the forward codec, targets as
        they are."""
        return [
            self._tensor(inputs, "inputs", self._forward),
            self._tensor(targets, "targets", CODEC_NONE),
        ]

    def _id(self, step: int, index: int) -> pb.MicrobatchId:
        return pb.MicrobatchId(step=step, index=index)

    @_swarm_errors
    async def forward(
        self, step: int, index: int, inputs: TensorLike, *, evaluate: bool = False
    ) -> tensor_pb2.Tensor:
        """The stage's outputs; the time the call waited at the replica is in `last_queued_s`.
        `evaluate`: a validation microbatch, whose activations the replica need not keep."""
        request = pb.StageForwardRequest(
            job=self.job_id,
            stage=self.stage,
            microbatch=self._id(step, index),
            tensors=[self._tensor(inputs, "inputs", self._forward)],
            reply_codec=self._forward,
            evaluate=evaluate,
        )
        header, tensors = await self._call(self.stub.Forward, request)
        self.last_queued_s = header.queued_seconds
        return tensors["outputs"]

    @_swarm_errors
    async def backward(
        self,
        step: int,
        index: int,
        inputs: TensorLike | None,
        grad_outputs: TensorLike,
        *,
        accumulate: bool = True,
        need_grad_inputs: bool = True,
    ) -> BackwardResult:
        """`inputs=None`: this replica did the forward and should still cache its activations
        (if not, it raises `ActivationsNotCached`: send it again with the inputs)."""
        tensors = [self._tensor(grad_outputs, "grad_outputs", self._backward)]
        if inputs is not None:
            tensors.insert(0, self._tensor(inputs, "inputs", self._forward))
        request = pb.StageBackwardRequest(
            job=self.job_id,
            stage=self.stage,
            microbatch=self._id(step, index),
            tensors=tensors,
            reply_codec=self._backward,
            accumulate=accumulate,
            need_grad_inputs=need_grad_inputs,
        )
        header, received = await self._call(self.stub.Backward, request)
        return BackwardResult(
            received.get("grad_inputs"), header.receipt, queued_seconds=header.queued_seconds
        )

    @_swarm_errors
    async def forward_backward(
        self,
        step: int,
        index: int,
        inputs: TensorLike,
        targets: TensorLike,
        *,
        accumulate: bool = True,
        need_grad_inputs: bool = True,
    ) -> BackwardResult:
        request = pb.StageForwardBackwardRequest(
            job=self.job_id,
            stage=self.stage,
            microbatch=self._id(step, index),
            tensors=self._inputs_and_targets(inputs, targets),
            reply_codec=self._backward,
            accumulate=accumulate,
            need_grad_inputs=need_grad_inputs,
        )
        header, received = await self._call(self.stub.ForwardBackward, request)
        return BackwardResult(
            received.get("grad_inputs"), header.receipt, header.loss_sum, header.queued_seconds
        )

    @_swarm_errors
    async def evaluate(
        self, step: int, index: int, inputs: TensorLike, targets: TensorLike
    ) -> float:
        """The last stage's loss sum of validation microbatch `index` at `step`'s parameters."""
        request = pb.StageForwardBackwardRequest(
            job=self.job_id,
            stage=self.stage,
            microbatch=self._id(step, index),
            tensors=self._inputs_and_targets(inputs, targets),
            evaluate=True,
        )
        header, _ = await self._call(self.stub.ForwardBackward, request)
        self.last_queued_s = header.queued_seconds
        return float(header.loss_sum)

    @_swarm_errors
    async def push(
        self,
        step: int,
        index: int,
        inputs: TensorLike,
        targets: TensorLike,
        accumulate: Sequence[int],
        route: Sequence[pb.Route],
        *,
        need_grad_inputs: bool,
        timeout: float,
        evaluate: bool = False,
    ) -> PushResult:
        """The push data plane: this replica computes its stage and pushes the microbatch on
        through the stages `route` names (see `stage_server.next_hop`), accumulating at the
        stages in `accumulate`. `timeout` covers the whole path."""
        request = pb.StagePushRequest(
            job=self.job_id,
            stage=self.stage,
            microbatch=self._id(step, index),
            tensors=self._inputs_and_targets(inputs, targets),
            accumulate=sorted(accumulate),
            route=list(route),
            need_grad_inputs=need_grad_inputs,
            evaluate=evaluate,
        )
        header, received = await self._call(self.stub.Push, request, timeout)
        return PushResult(
            received.get("grad_inputs"),
            list(header.receipts),
            set(header.uncertain),
            header.loss_sum,
            header.queued_seconds,
            list(header.path),
        )

    @_swarm_errors
    async def commit(
        self,
        step: int,
        microbatches: list[int],
        total_samples: int,
        *,
        phase: Any = pb.COMMIT_PHASE_BOTH,
        group: list[str] | None = None,
        group_index: int = 0,
        round: str = "",
        grad_scale: float | None = None,
        round_end: bool = False,
        eager: int = 0,
    ) -> pb.StageCommitResponse:
        request = pb.StageCommitRequest(
            job=self.job_id, stage=self.stage, step=step, microbatches=microbatches,
            total_samples=total_samples, phase=phase, group=group or [], group_index=group_index,
            round=round, grad_scale=grad_scale, round_end=round_end,
            eager=eager)  # type: ignore[arg-type]  # fmt: skip
        # APPLY is one local optimizer step: a replica that cannot do it within a hop's deadline
        # is hung, and must not hold the whole job for a commit's (it rejoins later).
        apply = phase == pb.COMMIT_PHASE_APPLY
        timeout = self._timeout if apply else self.job.runtime.commit_timeout_s
        response: pb.StageCommitResponse = await self.stub.Commit(request, timeout=timeout)
        return response

    @_swarm_errors
    async def discard(self, step: int) -> int:
        request = pb.StageDiscardRequest(job=self.job_id, stage=self.stage, step=step)
        response: pb.StageDiscardResponse = await self.stub.Discard(request, timeout=self._timeout)
        return response.dropped

    @_swarm_errors
    async def join(self, source: str, step: int) -> int:
        """Have this replica copy the replica at `source` in the background, until it is at
        `step`; returns the step it is at now (`step` once it is a copy to admit)."""
        request = pb.StageJoinRequest(job=self.job_id, stage=self.stage, source=source, step=step)
        response: pb.StageJoinResponse = await self.stub.Join(request, timeout=self._timeout)
        return response.step

    @_swarm_errors
    async def load_state(self, step: int, state: dict[str, torch.Tensor]) -> int:
        """Make this replica the one `state` describes (names as `export_state` gives them)."""
        call = self.stub.LoadState(timeout=self.job.runtime.commit_timeout_s)
        for name, tensor in state.items():
            header = pb.StageLoadStateRequest(job=self.job_id, stage=self.stage, step=step)
            # Cut from the tensor's memory as sent: no encoded copy of a whole tensor.
            for part in wire.split_tensor(header, name, tensor, self._chunk):
                await _write(call, part)
        await call.done_writing()
        response: pb.StageLoadStateResponse = await call
        return response.step

    @_swarm_errors
    async def info(self) -> pb.StageInfoResponse:
        response: pb.StageInfoResponse = await self.stub.Info(
            pb.StageInfoRequest(), timeout=self._timeout
        )
        return response

    @_swarm_errors
    async def download_state(
        self,
        include_optimizer: bool = False,
        prefix: str = "param/",
        follower: str = "",
        *,
        expect: ExpectedState,
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """The replica's state and step: parameters (names as in the whole model, with `prefix`
        removed) and, when asked, optimizer state (`optim/<index>/<key>`). A `follower` (a
        joining peer) has the replica keep its updates from that step on (`updates`). However
        large the state, the call lasts while bytes keep coming: it fails only when none came
        for `rpc_timeout_s`. Each tensor is checked as it comes (`expect`: its name, shape and
        dtype; at most `expect.max_state_bytes()` in all, `runtime.max_tensor_bytes` each): the
        first refused ends the call, before more is read or held."""
        state: dict[str, torch.Tensor] = {}

        async def keep(step: int, name: str, tensor: torch.Tensor) -> None:
            state[name.removeprefix(prefix) if prefix else name] = tensor

        step = await self.stream_state(keep, include_optimizer, follower, expect=expect)
        return step, state

    @_swarm_errors
    async def stream_state(
        self,
        sink: StateSink,
        include_optimizer: bool = False,
        follower: str = "",
        *,
        expect: ExpectedState,
    ) -> int:
        """`download_state`, each tensor handed to `sink(step, name, tensor)` as it comes (and
        no longer held here) rather than collected: a state larger than this process's memory
        goes to a file this way. The next tensor is read once `sink` returned, so a slow sink
        slows the sender (gRPC's flow control), and one that raises ends the call. Returns the
        state's step; the names are the replica's own."""
        call = self.stub.DownloadState(
            pb.StageDownloadStateRequest(
                job=self.job_id,
                stage=self.stage,
                include_optimizer=include_optimizer,
                follower=follower,
            )
        )
        try:
            return await self._receive_state(call, expect, sink)
        finally:
            call.cancel()  # refused or failed: the sender stops (nothing once the call ended)

    async def _receive_state(self, call: Any, expect: ExpectedState, sink: StateSink) -> int:
        why = (
            "the stage's parameters and an optimizer's state at 8 bytes a value, and "
            f"{wire.TENSOR_OVERHEAD_BYTES} bytes a tensor"
        )
        received = self._bounded(call, expect.max_state_bytes(), why, wire.TENSOR_OVERHEAD_BYTES)
        most = expect.max_state_tensors()
        names: set[str] = set()
        step = -1
        while (message := await received.next()) is not None:
            header, tensors = message
            if step >= 0 and header.step != step:
                raise self._refused(f"a state of step {step}, then of step {header.step}")
            step = header.step
            for name, tensor in tensors.items():
                if name in names:
                    raise self._refused(f"{name!r} twice")
                if len(names) == most:
                    raise self._refused(f"more than the {most} tensors stage {self.stage} has")
                self._check(expect.state_tensor, name, tensor)
                names.add(name)
                await sink(step, name, tensor)  # its own buffer (`_Bounded.next`): no copy
        self._check(expect.complete, names)  # a replica always has parameters
        return step

    @_swarm_errors
    async def updates(
        self, follower: str, from_step: int, *, expect: ExpectedState
    ) -> list[Followed]:
        """The updates the replica applied from `from_step` on, as (step, gradient sums in
        parameter order, total samples, clipping coefficient, whether it is a round's end);
        `follower` has those before. A
        negative `from_step` says the follower is done. Lasts while bytes keep coming, as
        `download_state`, and is checked as it comes as that is (`expect`: each update's
        gradient sums of the parameters' shapes and dtypes, the steps in order; in all at most
        what an update log keeps, `runtime.update_log_bytes`, or one update when larger)."""
        call = self.stub.Updates(
            pb.StageUpdatesRequest(
                job=self.job_id, stage=self.stage, follower=follower, from_step=from_step
            )
        )
        try:
            return await self._receive_updates(call, from_step, expect)
        finally:
            call.cancel()

    async def _receive_updates(
        self, call: Any, from_step: int, expect: ExpectedState
    ) -> list[Followed]:
        # An update log keeps at most update_log_bytes, or its last update whatever its size.
        limit = max(self.job.runtime.update_log_bytes, expect.max_update_bytes())
        why = (
            "runtime.update_log_bytes (within a stage server's --max-update-log-bytes), or one "
            "update when larger"
        )
        # No overhead charged: each tensor has its parameter's shape, so the sender cannot make
        # them many and tiny (and the bound stays what the log keeps).
        received = self._bounded(call, limit, why, 0)
        size = expect.num_parameters
        updates: list[Followed] = []
        # pool.mode = "local": a local step may take no sample, and a round's end comes before
        # its step's own update (same step); pool.overlap = "eager": an average may arrive at
        # any step (it moves no step)
        local = rule_of(self.job).rounds
        least = 0 if local else 1
        at, ended = -1, False  # the step the sender is at after the last update, and whether
        # a round ended there
        while (message := await received.next()) is not None:
            header, tensors = message
            scale = header.grad_scale if header.HasField("grad_scale") else 1.0
            end = header.round_end and local
            eager = header.eager if end else 0
            if not updates or len(updates[-1].grad_sums) == size:  # the one before is whole
                if eager not in (0, 1, 2) or (eager == 2) != (0 < header.boundary <= header.step):
                    raise self._refused(
                        f"an update of step {header.step} with eager operation {header.eager} "
                        f"of the round ending at {header.boundary}"
                    )
                if not updates:
                    in_order = header.step >= from_step
                else:
                    in_order = header.step == at and not (end and eager != 2 and ended)
                if not in_order:
                    raise self._refused(f"an update of step {header.step} out of order")
                if header.total_samples < least or not 0.0 < scale <= 1.0:
                    raise self._refused(
                        f"an update of {header.total_samples} samples with coefficient {scale}"
                    )
                if not end:
                    at, ended = header.step + 1, False
                elif eager != 2:
                    at, ended = header.step, True
                elif not updates:
                    at = header.step
                boundary = header.boundary if eager == 2 else -1
                updates.append(
                    Followed(header.step, [], header.total_samples, scale, end, eager, boundary)
                )
            last = updates[-1]
            if (header.step, header.total_samples, scale) != (last[0], last[2], last[3]):
                raise self._refused(
                    f"the update of step {last.step} with {len(last.grad_sums)} of {size} sums"
                )
            sums = last.grad_sums
            for name, tensor in tensors.items():
                if name != str(len(sums)):
                    raise self._refused(f"gradient sum {name!r} where {len(sums)} was due")
                self._check(expect.update_tensor, len(sums), tensor)
                sums.append(tensor)  # its own buffer: no copy
        if updates and len(updates[-1][1]) != size:
            raise self._refused(
                f"the update of step {updates[-1][0]} has {len(updates[-1][1])} of {size} sums"
            )
        return updates

    @property
    def _sender(self) -> str:
        return f"stage {self.stage}'s replica at {self.address}"

    def _bounded(self, call: Any, limit: int, why: str, overhead: int) -> _Bounded:
        stream = _progressing(call, self._timeout)
        return _Bounded(stream, self._sender, limit, why, self._max, overhead)

    def _refused(self, what: str) -> InvalidArgument:
        return InvalidArgument(f"{self._sender} sent {what}")

    def _check(self, check: Callable[..., None], *args: Any) -> None:
        """`check(*args)`, whose refusal names this replica."""
        try:
            check(*args)
        except InvalidArgument as e:
            raise self._refused(f"what stage {self.stage} would not load: {e}") from None


class Followed(NamedTuple):
    """An update a followed replica applied (`StageRuntime.apply_followed`'s arguments)."""

    step: int
    grad_sums: list[torch.Tensor]
    total_samples: int
    scale: float  # the clipping coefficient
    round_end: bool  # a round's end of pool.mode = "local"
    eager: int = 0  # pool.overlap = "eager": `stage_server.local_round.Eager`'s STEP or AVERAGE
    boundary: int = -1  # an AVERAGE's round (its end)


# (step, name, tensor) of each tensor of a state as it comes (`StageClient.stream_state`)
StateSink = Callable[[int, str, torch.Tensor], Awaitable[None]]


class ExpectedState(Protocol):
    """What a stage's state and its updates may hold (`swarm.model.state_checks.StateChecks`,
    from the job's layout of the stage): checked as each tensor arrives."""

    @property
    def num_parameters(self) -> int: ...

    def max_state_bytes(self) -> int: ...

    def max_state_tensors(self) -> int: ...

    def max_update_bytes(self) -> int: ...

    def state_tensor(self, name: str, tensor: torch.Tensor) -> None: ...

    def complete(self, names: Collection[str]) -> None: ...

    def update_tensor(self, index: int, tensor: torch.Tensor) -> None: ...


class _Bounded:
    """The messages of a server stream from `sender`, at most `limit` tensor bytes in all (`why`
    says where that bound comes from) and `max_tensor` a message, each tensor charged `overhead`
    bytes more than its payload (`wire.TENSOR_OVERHEAD_BYTES`: what it costs held, however
    small): a message declaring more than is left is refused from its header, before its bytes
    are read or allocated, and nothing after it is read."""

    def __init__(
        self,
        stream: AsyncIterator[Any],
        sender: str,
        limit: int,
        why: str,
        max_tensor: int,
        overhead: int,
    ) -> None:
        self.stream, self.sender, self.limit, self.why = stream, sender, limit, why
        self.max_tensor, self.overhead = max_tensor, overhead
        self.left = limit

    async def next(self) -> tuple[Any, dict[str, torch.Tensor]] | None:
        """The next message's header and tensors (decoded, the caller's own), or None at the
        end."""
        bound = min(self.max_tensor, self.left)
        try:
            received = await wire.receive(
                self.stream, max_bytes=bound, tensor_overhead=self.overhead
            )
            tensors = wire.decode_named(received, device="cpu", max_bytes=bound, owned=True)
        except wire.EndOfStream:
            return None
        except InvalidArgument as e:  # a header of too many tensors, or bytes that do not fit
            raise InvalidArgument(f"{self.sender} sent {e}") from None
        except ResourceExhausted as e:
            raise ResourceExhausted(
                f"{self.sender} sent more than it may: {e} ({self.limit - self.left} bytes came "
                f"before it, of at most {self.limit} in all: {self.why}; at most "
                f"runtime.max_tensor_bytes = {self.max_tensor} a tensor)"
            ) from None
        if not tensors:  # a replica sends at least one tensor a message
            raise InvalidArgument(f"{self.sender} sent a message without tensors")
        held = sum(len(p) for p in received.payloads)
        charged = self.overhead * len(tensors)
        self.left -= max(held, sum(t.nbytes for t in tensors.values())) + charged
        return received.header, tensors


def _aiter(call: Any) -> AsyncIterator[Any]:
    return call.__aiter__()  # type: ignore[no-any-return]


async def _progressing(call: Any, idle_s: float) -> AsyncIterator[Any]:
    """The messages of a server stream with a deadline that follows progress: each must come
    within `idle_s` of the one before, however long the whole stream takes."""
    stream = _aiter(call)
    while True:
        try:
            message = await asyncio.wait_for(anext(stream), idle_s)
        except StopAsyncIteration:
            return
        except TimeoutError:
            call.cancel()
            raise PeerUnavailable(f"no bytes for {idle_s:g}s: the transfer stalled") from None
        yield message


def named(receipts: Iterable[pb.Receipt], stage: int, peer: str) -> list[pb.Receipt]:
    """`receipts` with `stage`'s named `peer`: the name its caller chose it by (the route's, the
    coordinator's), which need not be the name the replica calls itself."""
    out = list(receipts)
    for r in out:
        if r.stage == stage:
            r.peer = peer
    return out
