"""What a stage's answer must hold to be the one asked for, checked where the stage client takes
it (`swarm.rpc.stage_client`), before anyone uses or passes it on.

A replica is a volunteer's process: its answer is its word. A Forward's answer without its outputs
raised a `KeyError` no retry caught (the trainer ended, or the scheduler's job); outputs of another
shape went on to the next stage, which refused them, and the honest replica there was backed off
and named in the failure for the liar's answer; a gradient nobody asked for was decoded all the
same (an audit's look at it). So the tensor asked for must be there, of the shape the call fixes:
what crosses a stage boundary is the microbatch's `[batch, seq, width]`, the width of the job's
boundary (`swarm.model.boundary`: d_model, a subspace boundary's rank, a bottleneck's), which a
middle stage's inputs cross with as its outputs do; an input gradient is the shape of what
crossed in. (Stage 0's outputs are checked but for their width, which its inputs, token ids, do
not show: the next stage refuses another.) One not asked for is dropped unread. A failing answer
is a `BadReply`: the replica's own fault (backed off, named in the cause), perhaps after it
accumulated, as any error of its own.

The bytes a shape declares are bounded by the wire already (`max_tensor_bytes`, the codec's
decoded size): a shape that is the call's bounds them to what the call could need."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

import torch

from swarm.errors import BadReply
from swarm.proto import tensor_pb2

__all__ = ["ANY", "crossing_shape", "needed", "shape_of"]

ANY = -1
"""In a shape `needed` checks: any size there."""

T = TypeVar("T", torch.Tensor, tensor_pb2.Tensor)


def shape_of(tensor: torch.Tensor | tensor_pb2.Tensor) -> list[int]:
    """A tensor's shape, or a message's (the shape it decodes to)."""
    return list(tensor.shape)


def crossing_shape(like: torch.Tensor | tensor_pb2.Tensor) -> list[int]:
    """What crosses a stage boundary for the microbatch `like` is of: `like`'s own shape where it
    crossed one (`[batch, seq, width]`), else (token ids `[batch, seq]`) `[batch, seq, ANY]`."""
    shape = shape_of(like)
    return shape if len(shape) == 3 else [*shape[:2], ANY]


def needed(tensors: Mapping[str, T], name: str, call: str, shape: Sequence[int] | None) -> T:
    """`tensors[name]`, of `shape` (None: of any; `ANY` in it: any size there); `BadReply` when
    it is missing or of another shape."""
    tensor = tensors.get(name)
    if tensor is None:
        raise BadReply(f"its {call} answer holds no {name!r} (it holds {sorted(tensors)[:4]})")
    got = shape_of(tensor)
    if shape is not None and (
        len(got) != len(shape) or any(w not in (g, ANY) for g, w in zip(got, shape, strict=True))
    ):
        wanted = ["any" if w == ANY else w for w in shape]
        raise BadReply(f"its {call} answer's {name!r} is {got[:8]}, not {wanted}")
    return tensor
