"""One part of a round summed: its contributions added in sender order, once, and the result every
sender receives (`Reduced`); each contribution's squared norm for the sum's checks. The owner's
bookkeeping around it is `stage_server.averaging.owner`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from swarm.proto import pool_pb2, tensor_pb2
from swarm.wire import chunking as wire
from swarm.wire.codec import CODEC_NONE, decode, encode

__all__ = ["Reduced", "Summer", "squares", "sum_in_order"]


class Reduced:
    """One part summed over its group, shared by every waiter: `tensor` (not to be modified in
    place) and the reply every sender receives. Uncompressed, each reply is cut from `tensor`'s
    memory as it is sent (a chunk's copy at a time, however many senders); a lossy codec's
    encoding is made once, when the sum is."""

    def __init__(
        self, tensor: torch.Tensor, message: tensor_pb2.Tensor | None, exact: torch.Tensor
    ) -> None:
        self.tensor, self.message = tensor, message  # `message`: a lossy codec's encoding
        self.exact = exact  # the sum before a lossy codec encoded it (`tensor` if none did)
        # encoded bytes of the sum, as each reply carries them
        self.wire_bytes = message.nbytes if message is not None else tensor.nbytes

    def replies(self, chunk_bytes: int) -> Iterator[pool_pb2.PoolReduceResponse]:
        if self.message is None:
            return wire.split_tensor(pool_pb2.PoolReduceResponse(), "sum", self.tensor, chunk_bytes)
        return wire.split(pool_pb2.PoolReduceResponse(tensors=[self.message]), chunk_bytes)


class Summer(Protocol):
    """How an `Averager` sums a part's contributions (`sum_in_order`); a test gives one averager a
    failing one, where a patch of the module's function would reach every averager the process
    holds (each replica's in a pool of replicas sharing one process)."""

    def __call__(
        self, values: list[torch.Tensor], owned: list[bool], codec: int, block_size: int
    ) -> Reduced: ...


def sum_in_order(
    values: list[torch.Tensor], owned: list[bool], codec: int, block_size: int
) -> Reduced:
    """The sum `((c0 + c1) + c2) + ...` of `values` in sender order; into `values[0]` or
    `values[1]` itself when it is `owned` (a received buffer no one else reads), else into a
    new tensor."""
    total = values[0]
    if len(values) > 1:
        if owned[0]:
            total.add_(values[1])  # the same bits as c0 + c1 into a new tensor
        elif owned[1]:  # c0 is the owner's own gradient: c1 + c0, the same bits (IEEE 754
            total = values[1].add_(values[0])  # addition commutes), and no tensor more
        else:
            total = values[0] + values[1]
        for v in values[2:]:
            total.add_(v)  # elementwise, so the same bits as ((c0 + c1) + c2) + ...
    if codec == CODEC_NONE:
        return Reduced(total, None, total)
    msg = encode(total, "sum", codec, block_size)
    return Reduced(decode(msg), msg, total)  # the owner keeps exactly what the senders decode


def squares(values: list[torch.Tensor]) -> list[float]:
    """Each contribution's squared norm, in float64 (before a sum may land in one of them)."""
    return [float(torch.linalg.vector_norm(v, dtype=torch.float64)) ** 2 for v in values]
