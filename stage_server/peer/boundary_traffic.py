"""What a replica sent across its stage's boundaries: bytes as encoded on the wire, and the tokens
they carried, per direction (`forward`: its outputs to the next stage; `backward`: its input
gradient to the stage before). Counted where the bytes leave, on either data plane: a Forward's
reply or a Push on to the next stage (forward), the input gradient of a Backward, a
ForwardBackward or a Push (backward).

Why per token: a boundary's bytes per token are the job's own figure (d_model values of the
codec's size, or fewer with a smaller boundary), the same at every microbatch size, and what a
link's rate divides to give the tokens per second it carries. Why tokens from the tensor: a
boundary tensor is `[batch, tokens, width]` whatever the model, so its values per token are its
last dimension; the tally never needs to know the model.

The tally restarts when the replica is bound to another (job, stage): its load reports carry it
(`LoadReport.boundary`), and `swarm status` sums them per boundary (`client.boundaries`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swarm.ops.boundary_bytes import Way
from swarm.proto import control_pb2 as cpb

__all__ = ["BOUNDARY_DIRECTIONS", "BoundaryTally", "tokens_of"]

BOUNDARY_DIRECTIONS: tuple[Way, Way] = ("forward", "backward")


def tokens_of(tensor: torch.Tensor) -> int:
    """The tokens a boundary tensor carries: its values over its last dimension's (one token's
    width); a tensor of fewer than two dimensions counts each value as a token."""
    if tensor.dim() < 2 or tensor.shape[-1] == 0:
        return tensor.numel()
    return tensor.numel() // tensor.shape[-1]


@dataclass
class BoundaryTally:
    """Bytes and tokens sent each way since the replica began serving its (job, stage)."""

    sent: dict[Way, list[int]] = field(
        default_factory=lambda: {d: [0, 0] for d in BOUNDARY_DIRECTIONS}
    )

    def add(self, direction: Way, wire_bytes: int, tokens: int) -> None:
        counts = self.sent[direction]
        counts[0] += wire_bytes
        counts[1] += tokens

    def report(self) -> cpb.BoundaryTraffic:
        (fb, ft), (bb, bt) = (self.sent[d] for d in BOUNDARY_DIRECTIONS)
        return cpb.BoundaryTraffic(
            forward_bytes=fb, forward_tokens=ft, backward_bytes=bb, backward_tokens=bt
        )
