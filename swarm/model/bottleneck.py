"""The learned bottleneck boundary (`model.boundary_bottleneck = r`), after Macrocosmos' residual
bottleneck models (ResBM, arXiv 2604.11947): what crosses between two stages is r learned
features per token instead of d_model, forward and backward.

The sending stage ends with a `Squeeze` (d_model -> r) and the receiving stage begins with an
`Expand` (r -> d_model), both ordinary parameters of the model, trained end to end:

    z  = A h + W2 gelu(W1 norm(h))        (Squeeze, on the last layer of the sending stage)
    h' = B z + V2 gelu(V1 z)              (Expand, on the first layer of the receiving stage)

A [r, d] and B [d, r] are the explicit low-rank identity path: initialised to U^T and U for a
seeded orthonormal U [d, r], so that at step 0 the boundary is the projection U U^T of the
residual (what the subspace boundary's basis gives, with nothing rebuilt from the token ids);
W2 and V2 start at zero, so the nonlinear encoder and decoder beside the identity path grow from
nothing as training needs them. Unlike the subspace boundary (`swarm.model.subspace`) the
boundary is no constraint on the other layers and no token ids travel: the model simply has a
narrow place at each cut, and autograd carries r values of gradient per token back through it.

The modules hang on the layers at each cut (`layers.<i>.squeeze`, `layers.<i+1>.expand`), so a
stage's parameters, optimizer state, averaging and checkpoints hold them as any other; the
whole model (`swarm local`) runs the same layers with the same cuts: it is the same model.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["EXPAND", "SQUEEZE", "Expand", "Squeeze", "attach", "half_parameters", "run_layer"]

SQUEEZE, EXPAND = "squeeze", "expand"  # the attribute names on a layer (its parameters' names)
_HIDDEN = 4  # the encoder's and decoder's hidden width, as a multiple of r
_INIT_STD = 0.02  # as the transformer's layers


class Squeeze(nn.Module):
    """d_model -> r: the end of a stage that sends across a bottleneck boundary."""

    def __init__(self, d_model: int, rank: int) -> None:
        super().__init__()
        self.identity = nn.Linear(d_model, rank, bias=False)
        self.norm = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, _HIDDEN * rank)
        self.out = nn.Linear(_HIDDEN * rank, rank)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.identity(h) + self.out(F.gelu(self.fc(self.norm(h))))


class Expand(nn.Module):
    """r -> d_model: the start of a stage that receives across a bottleneck boundary."""

    def __init__(self, d_model: int, rank: int) -> None:
        super().__init__()
        self.identity = nn.Linear(rank, d_model, bias=False)
        self.fc = nn.Linear(rank, _HIDDEN * rank)
        self.out = nn.Linear(_HIDDEN * rank, d_model)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.identity(z) + self.out(F.gelu(self.fc(z)))


def _cut_seed(seed: int, cut: int) -> int:
    digest = hashlib.blake2b(f"swarm-bottleneck/{seed}/{cut}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _initialise(squeeze: Squeeze | None, expand: Expand | None, seed: int, cut: int) -> None:
    """The two halves of cut `cut`, each built alone by its own stage, from the same generator:
    the sender's A and the receiver's B are U^T and U of the same U."""
    for half in (squeeze, expand):
        if half is None:
            continue
        gen = torch.Generator().manual_seed(_cut_seed(seed, cut))  # the same U for both
        d = max(half.identity.weight.shape)
        r = min(half.identity.weight.shape)
        u, _ = torch.linalg.qr(torch.randn(d, r, generator=gen, dtype=torch.float64))
        with torch.no_grad():
            half.identity.weight.copy_(u.T if isinstance(half, Squeeze) else u)
            half.fc.weight.normal_(0.0, _INIT_STD, generator=gen)
            half.fc.bias.zero_()
            half.out.weight.zero_()  # the nonlinear path starts at nothing
            half.out.bias.zero_()


def attach(
    layers: dict[int, nn.Module],
    cuts: Sequence[range],
    d_model: int,
    rank: int,
    seed: int | None,
) -> None:
    """Give the built `layers` (any contiguous subset of the model's) their halves of the
    bottleneck at every cut between the stages `cuts`: a `Squeeze` on each stage's last layer
    but the last stage's, an `Expand` on each stage's first layer but the first stage's. Each
    initialised in float64 from the job's `seed` and the cut's index; `seed` None leaves them as
    constructed (a layout on the meta device)."""
    for cut, (before, after) in enumerate(itertools.pairwise(cuts)):
        squeeze = Squeeze(d_model, rank).double() if before[-1] in layers else None
        expand = Expand(d_model, rank).double() if after[0] in layers else None
        if seed is not None:
            _initialise(squeeze, expand, seed, cut)
        if squeeze is not None:
            layers[before[-1]].add_module(SQUEEZE, squeeze)
        if expand is not None:
            layers[after[0]].add_module(EXPAND, expand)


def half_parameters(d_model: int, rank: int) -> tuple[int, int]:
    """Parameters of a `Squeeze` and of an `Expand`, counted on the meta device."""
    with torch.device("meta"):
        halves = Squeeze(d_model, rank), Expand(d_model, rank)
    squeeze, expand = (sum(p.numel() for p in half.parameters()) for half in halves)
    return squeeze, expand


def run_layer(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`layer` on `x`, through its bottleneck halves where it has them (a layer at a cut)."""
    expand, squeeze = layer._modules.get(EXPAND), layer._modules.get(SQUEEZE)
    if expand is not None:
        x = expand(x)
    x = layer(x)
    return x if squeeze is None else squeeze(x)
