"""The subspace boundary (`model.boundary_rank = r`): what crosses between two stages is r
coefficients per token instead of d_model features, forward and backward, and exactly so.

The model is constrained so that the residual stream at every boundary is

    h = E(tokens) + U c

with U a fixed orthonormal basis [d_model, r] and E a fixed table (token rows, plus position rows
for `gpt`; `llama` has rotary positions), both derived from the job's seed alone, so that every
process builds the same ones without exchanging them. A stage sends c = U^T (h - E(tokens)); the
next rebuilds h = U c + E(tokens) from the token ids, which travel with every hop beside c.
Backward, autograd through the same two maps carries U^T g: r values per token.

For that to be exact, everything that writes into the residual before the last boundary (the
learned embedding, each block's attention output and MLP down projection) writes through
P = U U^T (`project`), as part of the module's forward: autograd then gives the constrained
model's own gradients, every optimizer applies to them unchanged, and `swarm local` (the same
modules, no boundary) is the same model. The layers of the last stage write at full width: no
boundary follows them. See docs/compression.md ("The subspace boundary") for the maths.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

__all__ = ["Projected", "Subspace", "subspace_seed", "wire_targets", "wire_tokens"]


def subspace_seed(seed: int, rank: int) -> int:
    """The generator seed of a job's basis and table: a pure function of its seed and rank."""
    digest = hashlib.blake2b(f"swarm-subspace/{seed}/{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def wire_tokens(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Token ids as they travel beside a boundary's coefficients: the narrowest integer type of
    the wire that holds the vocabulary (uint8 for bytes, else int32), not int64: they are part of
    what every hop sends. A stage widens them back (`TensorChecks.tokens`)."""
    return ids.to(torch.uint8 if vocab <= 1 << 8 else torch.int32)


def wire_targets(targets: torch.Tensor, rank: int, vocab: int) -> torch.Tensor:
    """The targets as the push plane carries them through every hop: under a subspace boundary
    (`rank`, `model.boundary_rank`) as narrow as the token ids, where int64's 8 bytes a token
    would be a third of a boundary's bytes (48 coefficients in `hadamard3` take 18); int64
    otherwise, as ever. The last stage widens them back (`TensorChecks.targets`)."""
    return wire_tokens(targets, vocab) if rank else targets


class Subspace(nn.Module):
    """The basis U and the fixed table E of one job. Buffers, not parameters, and not persistent:
    they are never trained, never in a state or a checkpoint (every process rebuilds them)."""

    basis: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor

    def __init__(
        self, d_model: int, rank: int, vocab: int, positions: int, seed: int, scale: float
    ) -> None:
        super().__init__()
        # float64 on the CPU from its own generator: the same bits in every process and device.
        gen = torch.Generator().manual_seed(subspace_seed(seed, rank))
        q, _ = torch.linalg.qr(torch.randn(d_model, rank, generator=gen, dtype=torch.float64))
        self.register_buffer("basis", q.contiguous(), persistent=False)
        # The fixed table carries each token's identity in every direction (the learned part
        # only in span(U)); `scale` is the job's `model.boundary_table` (0: no table). Its
        # default, 0.1, is above the learned embedding's initial 0.02: at d_model 320 the
        # larger table cost far less loss per step (docs/compression.md, "Tuning").
        table = torch.randn(vocab, d_model, generator=gen, dtype=torch.float64) * scale
        self.register_buffer("tokens", table, persistent=False)
        pos = torch.randn(positions, d_model, generator=gen, dtype=torch.float64) * scale
        self.register_buffer("positions", pos, persistent=False)

    @property
    def rank(self) -> int:
        return int(self.basis.shape[1])

    def fixed(self, ids: torch.Tensor) -> torch.Tensor:
        """E(ids): [batch, seq, d_model], what every stage rebuilds from the token ids."""
        out = self.tokens[ids]
        if self.positions.shape[0]:
            out = out + self.positions[: ids.shape[1]]
        return out

    # Each map runs in the basis' dtype (the job's), outside any autocast: under bf16-mixed a
    # bfloat16 product would leave span(U) by its rounding, and the boundary's tensors would be
    # bfloat16 where every stage takes the job's dtype.
    def project(self, y: torch.Tensor) -> torch.Tensor:
        """P y = U U^T y over the last dimension: a write into the residual, kept in span(U)."""
        with _exact(y):
            return (y.to(self.basis.dtype) @ self.basis) @ self.basis.T

    def encode(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The coefficients c = U^T (h - E(ids)) that cross the boundary: [batch, seq, rank]."""
        with _exact(h):
            return (h.to(self.basis.dtype) - self.fixed(ids)) @ self.basis

    def decode(self, c: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The residual h = U c + E(ids) rebuilt on the far side of the boundary."""
        with _exact(c):
            return c.to(self.basis.dtype) @ self.basis.T + self.fixed(ids)

    def fold(
        self, state: dict[str, torch.Tensor], writes: tuple[str, ...], before: int
    ) -> dict[str, torch.Tensor]:
        """`state` (swarm names, the whole model) as ordinary weights computing the same
        function: the embedding's tables become E + (learned) P, each write of a layer before
        layer `before` (parameter names starting with one of `writes`) becomes P W and P b.
        The constraint is a property of the weights: the plain model needs no runtime."""
        p = self.basis.double() @ self.basis.double().T
        out = dict(state)
        for name, t in state.items():
            _, index, rest = name.split(".", 2)
            if int(index) >= before:
                continue
            if int(index) == 0:  # tok.weight [vocab, d] or pos.weight [seq_len, d]: rows
                fixed = self.tokens if rest.startswith("tok.") else self.positions
                out[name] = (t.double() @ p + fixed[: t.shape[0]].double()).to(t.dtype)
            elif rest.startswith(writes):  # weight [d, in] or bias [d]: the output side
                out[name] = (p @ t.double()).to(t.dtype)
        return out


def _exact(like: torch.Tensor) -> torch.autocast:
    """No autocast on `like`'s device (a no-op where none is on)."""
    return torch.autocast(like.device.type, enabled=False)


class Projected(nn.Module):
    """A write into the residual through P (`Subspace.project`), of a layer before the last
    boundary (a layer after it has none). Holds a reference to the job's one `Subspace`."""

    def __init__(self, subspace: Subspace) -> None:
        super().__init__()
        # Not a submodule: the subspace's buffers are the stage's, registered once there.
        self._subspace = [subspace]

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self._subspace[0].project(y)

    def embed(self, y: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The embedding's output: the learned embedding `y` in span(U), plus the fixed table."""
        return self._subspace[0].project(y) + self._subspace[0].fixed(ids)
