"""A round's sum as a lossy codec carried it: each part's as its owner encoded it, the bytes every
member decoded that part from (`all_reduce`'s `on_sum`). A replica's followers are sent those
bytes instead of the decoded values (`swarm.rpc.state_streams.Update.encoded`): fewer bytes, and
decoded they are bitwise what the pool applied."""

from __future__ import annotations

import math

from swarm.proto import tensor_pb2

__all__ = ["SentSum"]


class SentSum:
    """The parts' sums of one round as they come (called as `on_sum(k, message)`)."""

    def __init__(self) -> None:
        self._parts: dict[int, tensor_pb2.Tensor] = {}

    def __call__(self, k: int, message: tensor_pb2.Tensor) -> None:
        self._parts[k] = message

    def whole(self, numel: int) -> tuple[tensor_pb2.Tensor, ...]:
        """Every part's sum in the flat sum's order (parts are contiguous, in member order),
        when together they hold its `numel` values; else none (no lossy codec carried the
        round, or a part's sum is missing): its followers get the values themselves."""
        parts = tuple(self._parts[k] for k in sorted(self._parts))
        held = sum(math.prod(part.shape) for part in parts)
        return parts if parts and held == numel else ()
