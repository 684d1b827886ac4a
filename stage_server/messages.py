"""A replica's messages: requests decoded to named tensors within the served job's limits, replies
built and split into chunks, the data plane's bytes counted in the stage's metrics.

Why here: a request's size is refused from its header, before its bytes are allocated (one
microbatch's tensors at most), and its route (job, stage) is checked before its tensors are
decoded; no single message may size this process's memory. The limits are the served job's
(`Limits`, updated in place when a stage is installed), so everything holding them (the servicer,
the commit's averaging, a LoadState) reads those of the job served at that moment.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from google.protobuf.message import Message

from stage_server.metrics import StageMetrics
from stage_server.runtime import Receipt, StageRuntime
from stage_server.update_log import Update
from swarm.errors import InvalidArgument
from swarm.job.config import JobConfig
from swarm.proto import stage_pb2 as pb
from swarm.proto import tensor_pb2
from swarm.wire import chunking as wire
from swarm.wire import codec

__all__ = ["Limits", "Messages", "Route", "info_reply", "state_reply", "updates_reply"]

M = TypeVar("M", bound=Message)
Route = Callable[[str, int], None]  # raises NotFound unless (job, stage) is served here


@dataclass
class Limits:
    """The served job's wire settings; the defaults hold until a stage is installed."""

    chunk_bytes: int = 4 << 20  # `[runtime] chunk_bytes`: the most bytes of one message's chunk
    max_bytes: int = 1 << 30  # `[runtime] max_tensor_bytes`: the most bytes of one tensor
    block_size: int = 2048  # `[compression] block_size`: values per block of a blockwise codec

    def serve(self, job: JobConfig) -> None:
        """Take `job`'s settings (in place: every holder of this `Limits` sees them)."""
        self.chunk_bytes, self.max_bytes = job.runtime.chunk_bytes, job.runtime.max_tensor_bytes
        self.block_size = job.compression.block_size


class Messages:
    """Decoding and encoding with `limits`, counting bytes in `metrics`."""

    def __init__(self, limits: Limits, metrics: StageMetrics) -> None:
        self.limits, self.metrics = limits, metrics

    async def receive(
        self, requests: AsyncIterator[Any], max_request_bytes: int, route: Route
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        """A data-plane request's header and tensors: at most `max_request_bytes` (one
        microbatch's tensors: a header declaring more is refused before its bytes are allocated),
        routed by `route` before they are decoded."""
        limit = min(self.limits.max_bytes, max_request_bytes)
        received = await wire.receive(requests, max_bytes=limit)
        route(received.header.job, received.header.stage)
        tensors = wire.decode_named(received, device="cpu", max_bytes=limit)
        self.metrics.received(
            sum(t.nbytes for t in received.header.tensors),
            sum(t.numel() * t.element_size() for t in tensors.values()),
        )
        return received.header, tensors

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
        self, tensor: torch.Tensor | None, name: str, reply_codec: int
    ) -> list[tensor_pb2.Tensor]:
        """`tensor` as a reply's tensors: none for None, else one, encoded with `reply_codec`."""
        if tensor is None:
            return []
        msg = codec.encode(tensor, name, reply_codec, self.limits.block_size)
        self.metrics.sent(msg.nbytes, tensor.numel() * tensor.element_size())
        return [msg]

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
    return pb.StageInfoResponse(
        peer=peer,
        job=job_id,
        stage=rt.stage,
        num_stages=rt.job.training.stages,
        step=rt.step,
        device=str(rt.device),
        num_parameters=rt.num_parameters(),
        layers=rt.layers,
        pending_microbatches=len(rt.receipts()),
        receipts=sorted(rt.receipts()),
        next_receipts=sorted(rt.receipts(rt.step + 1)),
        applied_step=rt.applied[0],
        applied_scale=rt.applied[1],
    )


def updates_reply(updates: list[Update]) -> list[pb.StageUpdatesResponse]:
    """The Updates answer: one message per gradient sum of each update."""
    return [
        pb.StageUpdatesResponse(
            tensors=[codec.encode(g, str(i))],
            step=u.step,
            total_samples=u.total_samples,
            grad_scale=u.scale,
        )
        for u in updates
        for i, g in enumerate(u.grad_sums)
    ]


def state_reply(step: int, state: dict[str, torch.Tensor]) -> list[pb.StageDownloadStateResponse]:
    """The DownloadState answer: one message per tensor of the state."""
    return [
        pb.StageDownloadStateResponse(tensors=[codec.encode(v, k)], step=step)
        for k, v in state.items()
    ]
