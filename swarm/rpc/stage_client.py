"""A connection to one stage server: chunked bidi calls with a deadline on each. Every public call
raises `swarm.errors` (via `swarm.rpc.status.from_rpc_error`), never a gRPC error: callers catch
`PeerUnavailable`, `NotFound`, `Aborted`, `ActivationsNotCached`, ... and read no status details."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import grpc
import torch

from swarm.deadline import cancelled_since, cancels
from swarm.device.handover import Offer
from swarm.errors import BadReply, PeerUnavailable, SwarmError, WireError
from swarm.job.config import JobConfig
from swarm.job.rule import EagerOp, rule_of
from swarm.net import dial
from swarm.net.commit_auth import STATE_DIGEST_KEY, state_digest
from swarm.policy.parts import EQUAL_PARTS, Parts
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc, tensor_pb2
from swarm.rpc import client_stream, epoch, late_audit, lost_status
from swarm.rpc.control_replies import SplitStub, check_commit, check_info, control_reply_bytes
from swarm.rpc.push_call import PushCall
from swarm.rpc.reply_checks import crossing_shape, needed
from swarm.rpc.state_streams import ExpectedState, ReplicaStreams, StateSink, Update
from swarm.rpc.status import from_rpc_error
from swarm.wire import chunking as wire
from swarm.wire import codec
from swarm.wire.chunking import grpc_options
from swarm.wire.codec import CODEC_NONE
from swarm.wire.crossing import Crossing

__all__ = [
    "BackwardResult",
    "ExpectedState",
    "PushResult",
    "StageClient",
    "StateSink",
    "TensorLike",
    "WireCrossing",
    "WirePush",
    "as_tensor",
    "named",
]

P = ParamSpec("P")
R = TypeVar("R")


def _swarm_errors(call: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """The boundary of a `StageClient` method: a failed call (unary or streaming, at any point of
    the stream) raises the swarm error its status means (`StageClient.error_of`), chained to the
    gRPC error for the logs."""

    @functools.wraps(call)
    async def converted(*args: P.args, **kwargs: P.kwargs) -> R:
        client = args[0]
        assert isinstance(client, StageClient)  # a method's self
        limit = kwargs.get("timeout")  # the call's own, where it takes one; else the client's
        ends = time.monotonic() + (limit if isinstance(limit, float | int) else client.timeout_s)
        before = cancels()  # one under way already (a cleanup's call) is not this call's
        try:
            return await call(*args, **kwargs)
        except grpc.RpcError as e:
            raise await client.error_of(e, ends - time.monotonic()) from e
        except asyncio.CancelledError:
            if cancelled_since(before):
                raise  # our caller was cancelled
            # The channel was closed under the call (a client replaced or closed): to the
            # caller that is a peer that did not answer, not a cancellation of its own task.
            raise PeerUnavailable("the connection was closed during the call") from None

    return converted


# A tensor on the trainer's side: a torch tensor to encode, or a message received from another
# stage and passed on as it is (the trainer never decodes activations or gradients).
TensorLike = torch.Tensor | tensor_pb2.Tensor
WireCrossing = Crossing[TensorLike, TensorLike]
"""What crosses into a stage as the stage client sends it: tensors to encode, or messages passed
on as they are."""
WirePush = PushCall[TensorLike, TensorLike]
"""A push as the stage client sends it: tensors to encode, or messages passed on as they are."""


@dataclass(frozen=True)
class BackwardResult:
    grad_inputs: tensor_pb2.Tensor | None
    receipt: pb.Receipt
    loss_sum: float = 0.0
    queued_seconds: float = 0.0  # how long the call waited behind others at the replica
    digest: pb.SumCheck | None = None  # an audit's, where `digest_seed` asked for it


@dataclass(frozen=True)
class PushResult:
    grad_inputs: TensorLike | None
    receipts: list[pb.Receipt]  # of every stage that accumulated the microbatch
    uncertain: set[int]  # stages that may have accumulated it without a receipt here
    loss_sum: float
    queued_seconds: float
    path: list[str] = field(default_factory=list)  # the replicas of the later stages
    site: str = ""  # the replica's handover site (`swarm.device.site`; "": none)


def as_tensor(value: TensorLike) -> torch.Tensor:
    """Decode a received tensor message (tests and tools; the trainer has no need)."""
    return value if isinstance(value, torch.Tensor) else codec.decode(value)


class StageClient:
    def __init__(
        self,
        address: str,
        job: JobConfig,
        job_id: str,
        stage: int,
        token: str | None = None,
        *,
        direct: bool = False,
    ) -> None:
        """`direct`: a relayed `address` dialled past its relay, at its LAN address
        (`swarm.rpc.lan`)."""
        self.address, self.job, self.job_id, self.stage = address, job, job_id, stage
        self.direct = direct
        rt = job.runtime
        self.timeout_s = rt.rpc_timeout_s  # a call's deadline, where it names none of its own
        self._chunk, self._max = rt.chunk_bytes, rt.max_tensor_bytes
        # Any: the generated stubs type enum fields as their enum class, not int.
        # Activations (inputs, outputs) go with the forward codec, their gradients with the
        # backward one: a stage's replies are encoded as asked (`reply_codec`).
        self._forward: Any = codec.codec_from_name(job.compression.forward)
        self._backward: Any = codec.codec_from_name(job.compression.backward)
        self._block = job.compression.block_size
        self.channel = dial.channel(
            address, token=token, options=grpc_options(rt.max_message_bytes), direct=direct
        )
        # The coordinator's unary calls go on a channel taking answers of their size only
        # (`swarm.rpc.control_replies`), opened at the first (a trainer makes none).
        self._token = token
        self._control_channel: grpc.aio.Channel | None = None
        self._control_stub: Any = None
        self._closed = False
        self.stub: Any = SplitStub(stage_pb2_grpc.StageServiceStub(self.channel), self._control)
        self.last_queued_s = 0.0
        self._streams = ReplicaStreams(stage, address, self.timeout_s, self._max)

    async def close(self) -> None:
        self._closed = True  # no control channel is opened after: nothing would close it
        await self.channel.close()
        if self._control_channel is not None:
            await self._control_channel.close()

    def _control(self) -> Any:
        """The stub of the channel for Commit, Discard, Join and Info."""
        if self._closed:
            raise PeerUnavailable("the connection was closed before the call")
        if self._control_stub is None:
            options = grpc_options(control_reply_bytes(self.job))
            self._control_channel = dial.channel(
                self.address, token=self._token, options=options, direct=self.direct
            )
            self._control_stub = stage_pb2_grpc.StageServiceStub(self._control_channel)
        return self._control_stub

    async def error_of(self, error: grpc.RpcError, left_s: float) -> SwarmError:
        """The swarm error a failed call of this client's means; a status a write lost is asked
        again of the server first (`swarm.rpc.lost_status`), within what is `left_s` of the
        call's deadline (none past it: a slow or hostile server holds up no caller)."""

        async def probe(timeout: float) -> object:
            # The control channel's: an answer of Info's size only (`control_replies`).
            return await self._control().Info(pb.StageInfoRequest(), timeout=timeout)

        return from_rpc_error(await lost_status.asked_again(error, probe, left_s))

    def _tensor(self, t: TensorLike, name: str, with_codec: int) -> tensor_pb2.Tensor:
        if isinstance(t, tensor_pb2.Tensor):
            t.name = name  # a received message is ours to relabel; its bytes go on untouched
            return t
        return codec.encode(t, name, with_codec, self._block)

    async def _call(
        self, method: Any, request: Any, timeout: float | None = None, slot: Offer | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """The answer's header and tensors (messages; one written into `slot`, the caller's
        room for a co-located replica's answer, decoded already: `swarm.device.handover`)."""
        call = method(timeout=self.timeout_s if timeout is None else timeout)
        for msg in wire.split(request, self._chunk):
            await client_stream.write(call, msg)
        await client_stream.done_writing(call)
        try:
            received: wire.Received[Any] = await wire.receive_reply(
                call, max_bytes=self._max, handed=_from(slot) if slot is not None else None
            )
        except WireError as e:  # a reply stream no answer could be (past its bound, cut up)
            raise BadReply(f"its answer could not be read: {e}") from e
        tensors: dict[str, Any] = {}
        for t, payload in zip(received.header.tensors, received.payloads, strict=True):
            try:
                expected = codec.expected_payload(t)  # its header, validated
                if isinstance(payload, torch.Tensor):  # the slot's bytes, this process's own
                    tensors[t.name] = codec.decode(t, payload)
                    continue
            except (WireError, ValueError) as e:  # the replica's word: its fault (a device
                # error decoding here, a RuntimeError, is this process's own: not caught)
                raise BadReply(f"its answer's {t.name[:40]!r} does not decode: {e}") from e
            if len(payload) != expected:  # passed on, the next stage would refuse it
                raise BadReply(
                    f"its answer's {t.name[:40]!r} holds {len(payload)} bytes; its header "
                    f"says {expected}"
                )
            if len(t.data) != t.nbytes:  # it came in chunks: put the bytes back in one message
                t.data = bytes(payload)
            tensors[t.name] = t
        return received.header, tensors

    def _inputs_and_targets(
        self, crossing: WireCrossing, targets: TensorLike
    ) -> list[tensor_pb2.Tensor]:
        """The last stage's (or a push's) tensors: what crosses, with the targets as they are."""
        return self._crossing(crossing, self._tensor(targets, "targets", CODEC_NONE))

    def _crossing(
        self, crossing: WireCrossing, *beside: tensor_pb2.Tensor
    ) -> list[tensor_pb2.Tensor]:
        """What crosses into the stage, with the tensors `beside` it: the inputs in the forward
        codec, then `beside`, then, under a subspace boundary (`model.boundary_rank`), the
        microbatch's token ids as they are, from which the stage rebuilds the residual beside
        the coefficients."""
        tensors = [self._tensor(crossing.hidden, "inputs", self._forward), *beside]
        if crossing.tokens is not None:
            tensors.append(self._tensor(crossing.tokens, "tokens", CODEC_NONE))
        return tensors

    def _grad(self, received: dict[str, Any], call: str, like: TensorLike, asked: bool) -> Any:
        """The gradient of what crossed into this stage for the microbatch `like` is of, as the
        answer of `call` holds it (`swarm.rpc.reply_checks`); None where it was not asked for
        (one there all the same is dropped unread)."""
        if not asked:
            return None
        return needed(received, "grad_inputs", call, crossing_shape(like))

    def _id(self, step: int, index: int, accumulate: bool = False) -> pb.MicrobatchId:
        """Microbatch `(step, index)` as the current task's calls name it: with this stage's
        lease ticket only where the call accumulates (`swarm.rpc.epoch`)."""
        return epoch.microbatch_id(step, index, self.stage if accumulate else None)

    @_swarm_errors
    async def forward(
        self,
        step: int,
        index: int,
        crossing: WireCrossing,
        *,
        evaluate: bool = False,
    ) -> tensor_pb2.Tensor:
        """The stage's outputs of what crosses into it (`crossing`); the time the call waited at
        the replica is in `last_queued_s`. `evaluate`: a validation microbatch, whose
        activations the replica need not keep."""
        request = pb.StageForwardRequest(
            job=self.job_id,
            stage=self.stage,
            microbatch=self._id(step, index),
            tensors=self._crossing(crossing),
            reply_codec=self._forward,
            evaluate=evaluate,
            late=late_audit.current(),  # where it queues at the replica (`swarm.rpc.late_audit`)
        )
        header, tensors = await self._call(self.stub.Forward, request)
        self.last_queued_s = header.queued_seconds
        last = self.stage == self.job.training.stages - 1  # what it computes is no crossing
        shape = None if last else crossing_shape(crossing.hidden)
        return needed(tensors, "outputs", "Forward", shape)

    @_swarm_errors
    async def backward(
        self,
        step: int,
        index: int,
        crossing: WireCrossing | None,
        grad_outputs: TensorLike,
        *,
        accumulate: bool = True,
        need_grad_inputs: bool = True,
        digest_seed: int = 0,
    ) -> BackwardResult:
        """`crossing=None`: this replica did the forward and should still cache its activations
        (if not, it raises `ActivationsNotCached`: send it again with what crossed).
        `digest_seed`, with `accumulate` false: the digest of the parameter gradient too."""
        grad = self._tensor(grad_outputs, "grad_outputs", self._backward)
        tensors = [grad] if crossing is None else self._crossing(crossing, grad)
        request = pb.StageBackwardRequest(
            job=self.job_id,
            stage=self.stage,
            microbatch=self._id(step, index, accumulate),
            tensors=tensors,
            reply_codec=self._backward,
            accumulate=accumulate,
            need_grad_inputs=need_grad_inputs,
            digest_seed=digest_seed,
            late=late_audit.current(),
        )
        header, received = await self._call(self.stub.Backward, request)
        like = grad_outputs if crossing is None else crossing.hidden  # both [batch, seq, ...]
        return BackwardResult(
            self._grad(received, "Backward", like, need_grad_inputs),
            header.receipt,
            queued_seconds=header.queued_seconds,
            digest=header.digest if header.HasField("digest") else None,
        )

    @_swarm_errors
    async def forward_backward(
        self,
        step: int,
        index: int,
        crossing: WireCrossing,
        targets: TensorLike,
        *,
        accumulate: bool = True,
        need_grad_inputs: bool = True,
        digest_seed: int = 0,
    ) -> BackwardResult:
        request = pb.StageForwardBackwardRequest(
            job=self.job_id,
            stage=self.stage,
            microbatch=self._id(step, index, accumulate),
            tensors=self._inputs_and_targets(crossing, targets),
            reply_codec=self._backward,
            accumulate=accumulate,
            need_grad_inputs=need_grad_inputs,
            digest_seed=digest_seed,
            late=late_audit.current(),
        )
        header, received = await self._call(self.stub.ForwardBackward, request)
        return BackwardResult(
            self._grad(received, "ForwardBackward", crossing.hidden, need_grad_inputs),
            header.receipt,
            header.loss_sum,
            header.queued_seconds,
            header.digest if header.HasField("digest") else None,
        )

    @_swarm_errors
    async def evaluate(
        self,
        step: int,
        index: int,
        crossing: WireCrossing,
        targets: TensorLike,
    ) -> float:
        """The last stage's loss sum of validation microbatch `index` at `step`'s parameters."""
        request = pb.StageForwardBackwardRequest(
            job=self.job_id,
            stage=self.stage,
            microbatch=self._id(step, index),
            tensors=self._inputs_and_targets(crossing, targets),
            evaluate=True,
        )
        header, _ = await self._call(self.stub.ForwardBackward, request)
        self.last_queued_s = header.queued_seconds
        return float(header.loss_sum)

    @_swarm_errors
    async def push(
        self, call: WirePush, *, timeout: float, reply: Offer | None = None
    ) -> PushResult:
        """The push data plane: this replica computes its stage and pushes the microbatch on
        through the stages `call.route` names (see `stage_server.replica.next_hop`),
        accumulating at the stages in `call.accumulate`. `timeout` covers the whole path.
        `reply`: a co-located caller's slot for the gradient (`stage_server.replica.handing`)."""
        request = pb.StagePushRequest(
            job=self.job_id,
            stage=self.stage,
            microbatch=self._id(call.step, call.index),
            tensors=self._inputs_and_targets(call.crossing, call.targets),
            accumulate=sorted(call.accumulate),
            # the tickets of the stages it accumulates at, none other (`swarm.rpc.epoch`)
            tickets=epoch.push_tickets(call.accumulate),
            route=list(call.route),
            need_grad_inputs=call.need_grad_inputs,
            evaluate=call.evaluate,
            run=call.run,
            reply=reply.handle if reply is not None else None,
        )
        header, received = await self._call(self.stub.Push, request, timeout, reply)
        return PushResult(
            self._grad(received, "Push", call.crossing.hidden, call.need_grad_inputs),
            list(header.receipts),
            set(header.uncertain),
            header.loss_sum,
            header.queued_seconds,
            list(header.path),
            header.site,
        )

    @_swarm_errors
    async def record(
        self, step: int, index: int, run: int, *, tensors: bool
    ) -> tuple[pb.Commitment, dict[str, tensor_pb2.Tensor]]:
        """The push plane's record of run `run` of microbatch `(step, index)` at this replica:
        its commitment, and (`tensors`) the tensors it is of
        (`stage_server.replica.push_records`)."""
        request = pb.StageRecordRequest(
            job=self.job_id,
            stage=self.stage,
            microbatch=self._id(step, index),
            tensors_too=tensors,
            run=run,
        )
        header, received = await self._call(self.stub.Record, request)
        return header.commitment, received

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
        eager: EagerOp = EagerOp.NONE,
        parts: Parts = EQUAL_PARTS,  # the round's: `part_weights`, `contributors` on the wire
        check_seed: int = 0,  # PREPARE: the checksum of every part asked (0: none)
        audit_seeds: Sequence[int] = (),  # PREPARE: the same with others' audits' seeds
        group_peers: Sequence[str] = (),  # PREPARE: `group`'s peer ids (its round ticket's)
    ) -> pb.StageCommitResponse:
        request = pb.StageCommitRequest(
            job=self.job_id,
            stage=self.stage,
            step=step,
            microbatches=microbatches,
            total_samples=total_samples,
            phase=phase,
            group=group or [],
            group_peers=group_peers,
            group_index=group_index,
            round=round,
            grad_scale=grad_scale,
            round_end=round_end,
            check_seed=check_seed,
            audit_seeds=audit_seeds,
            part_weights=parts.weights,
            contributors=parts.contributors,
            eager=eager,  # type: ignore[arg-type]  # the job's EagerOp is the wire's enum by value
        )
        # APPLY is one local step: a replica hung past a hop's deadline rejoins later, not held for.
        apply = phase == pb.COMMIT_PHASE_APPLY
        timeout = self.timeout_s if apply else self.job.runtime.commit_timeout_s
        response: pb.StageCommitResponse = await self.stub.Commit(request, timeout=timeout)
        check_commit(response, request)
        return response

    @_swarm_errors
    async def discard(self, step: int) -> int:
        request = pb.StageDiscardRequest(job=self.job_id, stage=self.stage, step=step)
        response: pb.StageDiscardResponse = await self.stub.Discard(request, timeout=self.timeout_s)
        return response.dropped

    @_swarm_errors
    async def join(
        self, source: str, step: int, ticket: bytes = b"", rollback_epoch: int = 0
    ) -> int:
        """Have this replica copy the replica at `source` in the background, until it is at
        `step`; returns the step it is at now (`step` once it is a copy to admit). `ticket`: the
        scheduler's, naming this replica a follower of `source` (`swarm.net.follow_tickets`).
        `rollback_epoch`: the coordinator's, from which on the replica refuses work leased
        before it (`swarm.rpc.epoch`): one that joins after a rollback got no LoadState."""
        request = pb.StageJoinRequest(
            job=self.job_id, stage=self.stage, source=source, step=step, epoch=rollback_epoch
        )
        request.ticket = ticket
        response: pb.StageJoinResponse = await self.stub.Join(request, timeout=self.timeout_s)
        return response.step

    @_swarm_errors
    async def load_state(
        self, step: int, state: dict[str, torch.Tensor], rollback_epoch: int = 0
    ) -> int:
        """Make this replica the one `state` describes (names as `export_state` gives them). The
        state's digest goes with it: a replica under a scheduler loads only the state the
        scheduler signed (`swarm.net.commit_auth`). `rollback_epoch`: a rollback's, from which
        on the replica refuses work leased before it (`swarm.rpc.epoch`)."""
        # Off the event loop: a stage's whole state is hashed.
        digest = ((STATE_DIGEST_KEY, await asyncio.to_thread(state_digest, step, state)),)
        call = self.stub.LoadState(timeout=self.job.runtime.commit_timeout_s, metadata=digest)
        for name, tensor in state.items():
            header = pb.StageLoadStateRequest(
                job=self.job_id, stage=self.stage, step=step, epoch=rollback_epoch
            )
            # Cut from the tensor's memory as sent: no encoded copy of a whole tensor.
            for part in wire.split_tensor(header, name, tensor, self._chunk):
                await client_stream.write(call, part)
        await client_stream.done_writing(call)
        response: pb.StageLoadStateResponse = await call
        return response.step

    @_swarm_errors
    async def info(self) -> pb.StageInfoResponse:
        response: pb.StageInfoResponse = await self.stub.Info(
            pb.StageInfoRequest(), timeout=self.timeout_s
        )
        check_info(response, self.job)
        return response

    @_swarm_errors
    async def download_state(
        self,
        include_optimizer: bool = False,
        prefix: str = "param/",
        follower: str = "",
        *,
        expect: ExpectedState,
        ticket: bytes = b"",
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """The replica's state and step: parameters (names as in the whole model, with `prefix`
        removed) and, when asked, optimizer state (`optim/<index>/<key>`). A `follower` (a
        joining peer, named by the scheduler's `ticket` under a scheduler) has the replica keep
        its updates from that step on (`updates`). However large the state, the call lasts
        while bytes keep coming: it fails when none came for `rpc_timeout_s`, or when the whole
        state took longer than its bound at a minimum rate
        (`swarm.rpc.state_streams.STATE_MIN_RATE`, at least `STATE_FLOOR_S`). Each tensor is
        checked as it comes (`expect`: its name, shape and dtype; at most
        `expect.max_state_bytes()` in all, `runtime.max_tensor_bytes` each): the first refused
        ends the call, before more is read or held."""
        state: dict[str, torch.Tensor] = {}

        async def keep(step: int, name: str, tensor: torch.Tensor) -> None:
            state[name.removeprefix(prefix) if prefix else name] = tensor

        step = await self.stream_state(
            keep, include_optimizer, follower, expect=expect, ticket=ticket
        )
        return step, state

    @_swarm_errors
    async def stream_state(
        self,
        sink: StateSink,
        include_optimizer: bool = False,
        follower: str = "",
        *,
        expect: ExpectedState,
        ticket: bytes = b"",
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
                ticket=ticket,
            )
        )
        try:
            return await self._streams.receive_state(call, expect, sink)
        finally:
            call.cancel()  # refused or failed: the sender stops (nothing once the call ended)

    @_swarm_errors
    async def updates(
        self, follower: str, from_step: int, *, expect: ExpectedState, ticket: bytes = b""
    ) -> list[Update]:
        """The updates the replica applied from `from_step` on, in order; `follower` (named by
        `ticket`, as to `download_state`) has those before. A negative `from_step` says the
        follower is done. Lasts while bytes keep coming, as `download_state`, and is checked as
        it comes as that is (`expect`: each update's gradient sums of the parameters' shapes and
        dtypes, the steps in order, `swarm.rpc.stream_order`; in all at most what an update log
        keeps, `runtime.update_log_bytes`, or one update when larger)."""
        request = pb.StageUpdatesRequest(job=self.job_id, stage=self.stage, follower=follower)
        request.from_step, request.ticket = from_step, ticket
        call = self.stub.Updates(request)
        try:
            rounds, log_bytes = rule_of(self.job).rounds, self.job.runtime.update_log_bytes
            return await self._streams.receive_updates(
                call, from_step, expect, rounds=rounds, log_bytes=log_bytes
            )
        finally:
            call.cancel()


def named(receipts: Iterable[pb.Receipt], stage: int, peer: str) -> list[pb.Receipt]:
    """`receipts` with `stage`'s named `peer`: the name its caller chose it by (the route's, the
    coordinator's), which need not be the name the replica calls itself."""
    out = list(receipts)
    for r in out:
        if r.stage == stage:
            r.peer = peer
    return out


def _from(slot: Offer) -> wire.Handed:
    """The answer's handed-over tensor: only the one written into `slot`."""

    def handed(_index: int, meta: tensor_pb2.Tensor) -> torch.Tensor:
        if meta.handover != slot.handle or meta.nbytes != slot.nbytes:
            raise PeerUnavailable(f"{meta.name!r} was handed over, but not into this call's slot")
        return slot.read()

    return handed
