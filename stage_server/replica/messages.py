"""A replica's messages: requests decoded to named tensors within the served job's limits, replies
built and split into chunks, the data plane's bytes counted in the stage's metrics.

Why here: a request's size is refused from its header, before its bytes are allocated (one
microbatch's tensors at most), and its route (job, stage) is checked before its tensors are
decoded; no single message may size this process's memory. The limits are the served job's
(`Limits`, updated in place when a stage is installed), so everything holding them (the servicer,
the commit's averaging, a LoadState) reads those of the job served at that moment.

A job's `[runtime]` is written by whoever submitted it, and a peer defends itself with it: so
each of its limits is clamped by the peer's own (`PeerLimits`, the stage server's flags), whatever
the job says: the smaller of the two for a maximum, chunks kept within the peer's floor and
ceiling (a job's 1-byte chunks would make a million messages of a megabyte), a message room for
a chunk and its header within the peer's ceiling (gRPC holds a whole message before any check).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch
from google.protobuf.message import Message

from stage_server.peer.boundary_traffic import tokens_of
from stage_server.peer.limits import MESSAGE_HEADROOM, PeerLimits
from stage_server.peer.metrics import StageMetrics
from stage_server.replica.handing import Handing, Outgoing
from stage_server.replica.push_records import Arrived
from stage_server.replica.runtime import Receipt, StageRuntime
from stage_server.replica.snapshot import Snapshot
from swarm.device.claims import Claims
from swarm.device.host_copies import HostCopies, TorchHostCopies
from swarm.device.sharing import Window, microbatches_held, window_for
from swarm.errors import InvalidArgument
from swarm.job.config import JobConfig, RuntimeConfig
from swarm.ops.boundary_bytes import Way
from swarm.proto import stage_pb2 as pb
from swarm.proto import tensor_pb2
from swarm.rpc.state_streams import FLAT, Update
from swarm.wire import chunking as wire
from swarm.wire import codec
from swarm.wire.budget import Held

__all__ = [
    "Limits",
    "Messages",
    "Route",
    "info_reply",
    "state_reply",
    "updates_reply",
]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
Route = Callable[[str, int], None]  # raises NotFound unless (job, stage) is served here


@dataclass
class Limits:
    """The served job's wire settings within `peer`'s; the defaults hold until a stage is
    installed."""

    # The setting behind `max_bytes`, as refusals name it.
    max_bytes_name: ClassVar[str] = (
        "the job's runtime.max_tensor_bytes, at most this peer's --max-tensor-bytes"
    )

    peer: PeerLimits = field(default_factory=PeerLimits)
    chunk_bytes: int = 4 << 20  # `[runtime] chunk_bytes`: the most bytes of one message's chunk
    max_bytes: int = 1 << 30  # `[runtime] max_tensor_bytes`: the most bytes of one tensor
    block_size: int = 2048  # `[compression] block_size`: values per block of a blockwise codec
    update_log_bytes: int = 4 << 30  # `[runtime] update_log_bytes`: updates kept for copies
    max_message_bytes: int = 64 << 20  # `[runtime] max_message_bytes`: one gRPC message
    activation_cache: int = 64  # `[runtime] activation_cache`: microbatches' activations kept
    max_queue: int = 64  # `[runtime] max_queue`: pushed microbatches queued before Busy
    # whether the activation cache's byte bound was sized for this peer (`bound`): by its
    # device's free memory, or by its operator; what it holds is said only then (`capacity`)
    cache_sized: bool = False
    # the host's registry of who computes on each device (`swarm.device.claims`)
    claims: Claims = field(default_factory=Claims)
    _window: Window | None = field(default=None, repr=False)  # the served replica's, to close
    # the clamps said last: a job's are said once as it is served, not kept for every job
    _said: tuple[Any, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        self._clamp(
            dataclasses.replace(
                RuntimeConfig(),
                chunk_bytes=self.chunk_bytes,
                max_tensor_bytes=self.max_bytes,
                update_log_bytes=self.update_log_bytes,
                max_message_bytes=self.max_message_bytes,
                activation_cache=self.activation_cache,
                max_queue=self.max_queue,
            )
        )

    def serve(self, job: JobConfig) -> None:
        """Take `job`'s settings within this peer's (in place: every holder of this `Limits`
        sees them); a job's clamped values are logged once."""
        clamped = self._clamp(job.runtime)
        self.block_size = job.compression.block_size
        said = (job.name, *clamped)
        if clamped and said != self._said:
            self._said = said
            log.warning(
                "job %s: its [runtime] is clamped by this peer's limits: %s",
                job.name,
                ", ".join(f"{k} {asked} -> {used}" for k, asked, used in clamped),
            )

    def bound(self, runtime: StageRuntime) -> None:
        """Bound what `runtime` keeps by the served job's limits: the updates kept for peers
        copying it, and the activations kept for Backwards, by count and by bytes (on CUDA
        this server's part of the device when the peer left its flag alone, within the device's
        free memory: `swarm.device.sharing`). The window served before gives its part back."""
        peer = self.peer
        runtime.updates.bound(self.update_log_bytes, peer.max_followers, peer.follower_ttl_s)
        runtime.activation_cache = self.activation_cache
        self.release()
        flag = peer.max_activation_cache_bytes
        runtime.window = window_for(
            flag, runtime.device, runtime.memory, self.claims, keeps=not runtime.is_last
        )
        self._window = runtime.window
        self.cache_sized = runtime.window.sized

    def release(self) -> None:
        """The served replica's window gives its part of the device back (nothing served)."""
        if self._window is not None:
            self._window.close()
            self._window = None

    def capacity(self, runtime: StageRuntime) -> int:
        """Microbatches whose activations `runtime` keeps for their Backward, as its load reports
        say (trainers size their window by it, `swarm.policy.window`): 0 (not said) where its
        bound was not sized for this peer (`cache_sized`), at the last stage (its ForwardBackward
        keeps nothing between calls) and before its first microbatch was measured."""
        if runtime.is_last or not self.cache_sized:
            return 0
        return microbatches_held(
            runtime.activation_cache, runtime.window.bytes, runtime.cached_footprint
        )

    def clamp(self, job: JobConfig) -> JobConfig:
        """`job` with the [runtime] limits this peer serves it with (`serve` took it): for the
        clients a replica makes (its push plane's next hop, the member it copies), whose
        answers are bounded as its own requests are."""
        runtime = dataclasses.replace(job.runtime, **self._used())
        return dataclasses.replace(job, runtime=runtime)

    def _used(self) -> dict[str, Any]:
        """The `[runtime]` values this peer serves the job with, by their job keys."""
        return {
            "chunk_bytes": self.chunk_bytes,
            "max_tensor_bytes": self.max_bytes,
            "update_log_bytes": self.update_log_bytes,
            "max_message_bytes": self.max_message_bytes,
            "activation_cache": self.activation_cache,
            "max_queue": self.max_queue,
        }

    def _clamp(self, rt: RuntimeConfig) -> list[tuple[str, int, int]]:
        """Take `rt`'s limits within the peer's: `(name, asked, used)` of each changed."""
        peer = self.peer
        self.chunk_bytes = min(max(rt.chunk_bytes, peer.min_chunk_bytes), peer.max_chunk_bytes)
        self.max_bytes = min(rt.max_tensor_bytes, peer.max_tensor_bytes)
        self.update_log_bytes = min(rt.update_log_bytes, peer.max_update_log_bytes)
        # Room for a chunk (raised to the peer's floor, perhaps) and its header; within the
        # peer's ceiling, which `PeerLimits` keeps above its largest chunk and a header.
        self.max_message_bytes = max(
            min(rt.max_message_bytes, peer.max_message_bytes), self.chunk_bytes + MESSAGE_HEADROOM
        )
        self.activation_cache = min(rt.activation_cache, peer.max_activation_cache)
        self.max_queue = min(rt.max_queue, peer.max_queue)
        used = self._used()
        return [(k, asked, used[k]) for k in used if (asked := getattr(rt, k)) != used[k]]


class Messages:
    """Decoding and encoding with `limits`, counting bytes in `metrics`."""

    def __init__(
        self, limits: Limits, metrics: StageMetrics, copies: HostCopies | None = None
    ) -> None:
        self.limits, self.metrics = limits, metrics
        # How device tensors reach the host: called on the worker thread, never on the loop.
        self.copies: HostCopies = copies or TorchHostCopies()
        # Boundary tensors handed over to co-located replicas (`handing`), on the push plane.
        self.handing = Handing(metrics)

    async def receive(
        self,
        requests: AsyncIterator[Any],
        max_request_bytes: int,
        route: Route,
        held: Held,
        admit: Callable[[Any], None] | None = None,
        handed: bool = False,
    ) -> tuple[Any, dict[str, torch.Tensor], dict[str, Arrived]]:
        """A data-plane request's header, its tensors decoded, and the same as they came
        (`Arrived`: what a push record keeps, `stage_server.replica.push_records`). `handed`:
        some may be handed over by a co-located replica (`Handing.take`); else such a request
        is refused. From the
        header, before a byte of the body is allocated: routed by `route`, then `admit(header)`
        (a full replica raises Busy), its size at most `max_request_bytes` (one microbatch's
        tensors) and the tensor limit, and its size within what is free of `held`'s budget; its
        bytes are held there as they come (the call holds them until it ends)."""
        limit = min(self.limits.max_bytes, max_request_bytes)
        name = (
            self.limits.max_bytes_name
            if limit == self.limits.max_bytes
            else "the most one microbatch's tensors take"
        )

        def check(header: Any) -> None:
            route(header.job, header.stage)
            if admit is not None:
                admit(header)

        # The body's bytes are held as they come (`Held.arriving`): headers that declare a
        # body and send none hold nothing (issue 44, N6).
        started = time.perf_counter()  # the call came: its bytes follow (a link rate)
        received = await wire.receive(
            held.arriving(requests),
            max_bytes=limit,
            admit=check,
            reserve=held.expect,
            limit_name=name,
            handed=self.handing.take if handed else None,
        )
        seconds = time.perf_counter() - started
        wire_bytes = sum(t.nbytes for t in received.header.tensors)
        # the link's rate: of the bytes that crossed it (none of a handed-over tensor's)
        linked = sum(t.nbytes for t in received.header.tensors if not t.HasField("handover"))
        self.metrics.moved("down", linked, seconds)
        tensors = await wire.decode_named_async(  # lossy values widened off the loop
            received, device="cpu", max_bytes=limit, reserve=held.reserve
        )
        self.metrics.received(
            wire_bytes,
            sum(t.numel() * t.element_size() for t in tensors.values()),
        )
        came = zip(received.header.tensors, received.payloads, strict=True)
        return received.header, tensors, {t.name: Arrived.of(t, p) for t, p in came}

    @staticmethod
    def need(tensors: dict[str, torch.Tensor], *names: str) -> list[torch.Tensor]:
        """The tensors `names`, in order; INVALID_ARGUMENT when one is missing."""
        missing = [n for n in names if n not in tensors]
        if missing:
            raise InvalidArgument(f"missing tensors {missing}; got {sorted(tensors)}")
        return [tensors[n] for n in names]

    @staticmethod
    def reply_codec(value: int) -> int:
        """The codec a request asks its reply in, when it is one this server knows."""
        if value not in codec.CODECS.values():
            raise InvalidArgument(f"unknown reply codec {value}")
        return value

    def encode(
        self,
        tensor: torch.Tensor | None,
        name: str,
        reply_codec: int,
        direction: Way,
        into: tensor_pb2.Handover | None = None,
    ) -> list[tensor_pb2.Tensor]:
        """`tensor` as a reply's tensors: none for None, else one, encoded with `reply_codec`
        and counted as sent `direction` across the stage's boundary; written into the caller's
        slot `into` when there is one that opens from here (`Handing.fill`). It waits for the
        device's copy to the host: call it on the worker thread."""
        if tensor is None:
            return []
        return [self.encode_one(tensor, name, reply_codec, direction, into)[0]]

    def encode_one(
        self,
        tensor: torch.Tensor,
        name: str,
        reply_codec: int,
        direction: Way,
        into: tensor_pb2.Handover | None = None,
    ) -> tuple[tensor_pb2.Tensor, torch.Tensor | None]:
        """`encode`'s one message, and the payload written into the slot `into` where it was
        (None: its bytes are in the message): what the caller decodes from the slot, for a
        push's record to keep without the message's copies."""
        if into is None:
            return self.send_on(tensor, name, reply_codec, direction), None
        msg, payload = codec.encode_payload(tensor, name, reply_codec, self.limits.block_size)
        filled: torch.Tensor | None = payload
        if not self.handing.fill(msg, payload, into):
            filled = None
            with self.copies.to_host(payload) as on_host:
                msg.data = on_host.numpy().tobytes()
        self._sent(msg, tensor, direction)
        return msg, filled

    def hand_on(
        self,
        tensor: torch.Tensor,
        name: str,
        with_codec: int,
        direction: Way,
        near: bool,
        far: bool,
    ) -> Outgoing:
        """`send_on`'s outputs for the push plane's next hop: handed over already (`near`, a
        co-located replica may take them), on the host already (`far`, one may not), each
        made later if a try needs it. On the worker thread, as `encode`."""
        msg, payload = codec.encode_payload(tensor, name, with_codec, self.limits.block_size)
        out = Outgoing(msg, payload, self.copies, self.handing)
        try:
            if near and self.handing.handover is not None:
                out.handed()
            if far or self.handing.handover is None:
                out.wire()
        except BaseException:
            out.release()  # offered already: nobody else would let it go
            raise
        self._sent(msg, tensor, direction)
        return out

    def send_on(
        self, tensor: torch.Tensor, name: str, with_codec: int, direction: Way
    ) -> tensor_pb2.Tensor:
        """`tensor` encoded with `with_codec`, copied to the host through `copies`, and counted
        as sent `direction`: a reply's tensor, or the push plane's outputs, which its next hop
        sends on as they are (once per microbatch: a try on another replica is not counted
        again). On the worker thread, as `encode`."""
        msg = codec.encode(
            tensor, name, with_codec, self.limits.block_size, host=self.copies.to_host
        )
        self._sent(msg, tensor, direction)
        return msg

    def beside(self, tensor: torch.Tensor, name: str) -> tensor_pb2.Tensor:
        """`tensor`, the targets or a subspace boundary's token ids that the push plane passes
        on beside its outputs, encoded as it is and counted as sent (not in the boundary's
        figure, which is its tensor's). Once per microbatch, as the outputs: a try on another
        replica sends the same message."""
        msg = codec.encode(tensor, name)
        self.metrics.passed_on(msg.nbytes, tensor.numel() * tensor.element_size())
        return msg

    def _sent(self, msg: tensor_pb2.Tensor, tensor: torch.Tensor, direction: Way) -> None:
        raw = tensor.numel() * tensor.element_size()
        self.metrics.sent(msg.nbytes, raw, direction, tokens_of(tensor))

    def took(self, msg: tensor_pb2.Tensor, tensor: torch.Tensor) -> None:
        """`msg`, decoded to `tensor`, came back in an answer (the push plane's gradient of
        this stage's outputs): counted as received, as a request's tensors are."""
        self.metrics.received(msg.nbytes, tensor.numel() * tensor.element_size())

    def split(self, msg: M) -> Iterator[M]:
        """`msg` in chunks of at most the served job's chunk size."""
        return wire.split(msg, self.limits.chunk_bytes)

    def receipt(self, r: Receipt, peer: str, pending: int) -> pb.Receipt:
        """`r` as the trainer's ledger takes it; `pending`: the microbatches now accumulated."""
        self.metrics.accumulated(0 if r.duplicate else r.samples, pending)
        return pb.Receipt(
            peer=peer,
            stage=r.stage,
            samples=r.samples,
            duplicate=r.duplicate,
            microbatch=pb.MicrobatchId(step=r.step, index=r.index),
        )


def info_reply(peer: str, job_id: str, rt: StageRuntime | None) -> pb.StageInfoResponse:
    """Where the replica is (for the coordinator: its step, its receipts, its last update)."""
    if rt is None:
        return pb.StageInfoResponse(peer=peer)
    # The calls in flight before the receipts: one that ends between the two reads is named in
    # both, never in neither (`stage_server.replica.in_flight`). The receipts before their runs:
    # each has its run set before it (`StepSums.received`), so the runs read after hold every
    # receipt's (one read without would name run 0 and be voided).
    # Of the steps its receipts are (older pushes are nobody's concern), within the bound the
    # coordinator holds Info to (`swarm.rpc.control_replies.check_info`): one past it refused
    # the whole answer, and left this replica out
    flying = [
        pb.PushInFlight(step=s, index=i, run=r)
        for s, i, r in rt.in_flight.listed()
        if s in (rt.step, rt.step + 1)
    ][: 2 * rt.job.training.microbatches_per_step]
    receipts, following = sorted(rt.receipts()), sorted(rt.receipts(rt.step + 1))
    runs, next_runs = rt.receipt_runs(), rt.receipt_runs(rt.step + 1)
    return pb.StageInfoResponse(
        peer=peer,
        job=job_id,
        stage=rt.stage,
        num_stages=rt.job.training.stages,
        step=rt.step,
        device=str(rt.device),
        num_parameters=rt.num_parameters(),
        layers=rt.layers,
        pending_microbatches=len(receipts),
        receipts=receipts,
        receipt_runs=[runs.get(index, 0) for index in receipts],
        next_receipts=following,
        next_receipt_runs=[next_runs.get(index, 0) for index in following],
        applied_step=rt.applied[0],
        applied_scale=rt.applied[1],
        round_synced=rt.round.synced,  # -1, 0 without a round (`stage_server.replica.no_round`)
        round_samples=rt.round.samples,
        state_epoch=rt.sums.state_epoch,  # not the Join's: its copy may not have loaded
        in_flight=flying,
    )


def updates_reply(updates: list[Update], chunk_bytes: int) -> Iterator[pb.StageUpdatesResponse]:
    """The Updates answer, built as it is sent: one message per gradient sum of each update, in
    chunks of at most `chunk_bytes` cut from the log's own tensors (nothing encoded ahead); or,
    for an update the pool's averaging carried in a lossy codec, one per part of its flat sum,
    as those bytes (`Update.encoded`, named `flat/<j>`: `swarm.rpc.state_streams.FlatSum`)."""
    for u in updates:
        for j, part in enumerate(u.encoded):
            header = _update_header(u)
            sent = header.tensors.add()
            sent.CopyFrom(part)
            sent.name = f"{FLAT}{j}"
            yield from wire.split(header, chunk_bytes)
        for i, g in enumerate([] if u.encoded else u.grad_sums):
            yield from wire.split_tensor(_update_header(u), str(i), g, chunk_bytes)


def _update_header(u: Update) -> pb.StageUpdatesResponse:
    return pb.StageUpdatesResponse(
        step=u.step,
        total_samples=u.total_samples,
        grad_scale=u.scale,
        round_end=u.round_end,
        eager=u.eager,  # type: ignore[arg-type]  # `EagerOp` is the wire's
        boundary=u.boundary,
    )


def state_reply(snapshot: Snapshot, chunk_bytes: int) -> Iterator[pb.StageDownloadStateResponse]:
    """The DownloadState answer, built as it is sent: one message per tensor of the state, in
    chunks of at most `chunk_bytes` cut from the tensor; each tensor is let go of as it goes, so
    the snapshot shrinks while it streams."""
    return snapshot.reply(lambda: pb.StageDownloadStateResponse(step=snapshot.step), chunk_bytes)
