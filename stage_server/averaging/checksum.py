"""A contributor's side of the linear checksum over the parts aggregators own (issue 43, item 4;
the coordinator's side, and why, is `scheduler.coordinator.sum_checks`).

Summation is linear: for any vector r, r·(Σ_j x_j) = Σ_j r·x_j. The coordinator sends the
replicas (never the aggregators) a secret seed with each PREPARE; each contributor j draws r from
it and reports, for every part an aggregator owns, r·x_j over what it contributed, Σ_i |r_i·x_ji|
and ‖x_j‖ (the scales its roundings are bounded by) and r·S over the sum it got back. An
aggregator that answers a sum S' ≠ S cannot make r·S' agree with the others' r·x without knowing
r: with r Gaussian, r·(S' - S) is a normal of deviation ‖S' - S‖.

r depends only on the seed and an element's place in the flat vector (drawn in aligned blocks of
`BLOCK`, each from its own generator), so every contributor draws the same r whatever its slices,
and no copy of a whole part is made: a block's r and values (in float64, on the host) at a time.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, field

import torch

from swarm.proto import stage_pb2 as pb

__all__ = ["BLOCK", "PartChecks", "dots", "weights"]

# r is drawn this many elements at a time; a float64 dot over one block rounds by at most
# BLOCK·2^-53 of its magnitude (the coordinator's tolerance counts on it: `sum_checks`).
BLOCK = 1 << 16


def weights(seed: int, block: int) -> torch.Tensor:
    """r over elements [block·BLOCK, (block+1)·BLOCK) of the flat vector: float64 normals from a
    generator seeded by the round's seed and the block (hashed: neighbouring blocks' generators
    are unrelated)."""
    digest = hashlib.blake2b(struct.pack("<QQ", seed, block), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    return torch.randn(BLOCK, generator=generator, dtype=torch.float64)


def dots(seed: int, start: int, values: torch.Tensor) -> tuple[float, float, float]:
    """(r·values, Σ|r_i·values_i|, Σ values_i²), `values` being elements `start`.. of the flat
    vector (1-D, on any device), a block at a time."""
    dot: list[float] = []
    magnitude: list[float] = []
    squares: list[float] = []
    pos, end = start, start + values.numel()
    while pos < end:
        block, offset = divmod(pos, BLOCK)
        stop = min(end, (block + 1) * BLOCK)
        r = weights(seed, block)[offset : offset + stop - pos]
        x = values[pos - start : stop - start].to(device="cpu", dtype=torch.float64)
        squares.append(float(torch.dot(x, x)))
        product = r.mul_(x)  # r is this call's own: no second buffer
        dot.append(float(product.sum()))
        magnitude.append(float(product.abs_().sum()))
        pos = stop
    return math.fsum(dot), math.fsum(magnitude), math.fsum(squares)


@dataclass
class _Part:
    dot: list[float] = field(default_factory=list)
    magnitude: list[float] = field(default_factory=list)
    squares: list[float] = field(default_factory=list)
    sum_dot: list[float] = field(default_factory=list)


class PartChecks:
    """One contributor's checksums of one round (seed `seed`), slice by slice: `contributed`
    before a slice's values are sent (and overwritten by its sum), `summed` once its sum is in
    place; `report()` gives one `SumCheck` per part, with the unit roundoff of the values' dtype
    (the owner sums in it)."""

    def __init__(self, seed: int) -> None:
        self.seed, self.unit = seed, 0.0
        self._parts: dict[int, _Part] = {}

    def contributed(self, part: int, start: int, values: torch.Tensor) -> None:
        if values.dtype.is_floating_point:
            self.unit = max(self.unit, torch.finfo(values.dtype).eps / 2)
        dot, magnitude, squares = dots(self.seed, start, values)
        p = self._parts.setdefault(part, _Part())
        p.dot.append(dot)
        p.magnitude.append(magnitude)
        p.squares.append(squares)

    def summed(self, part: int, start: int, values: torch.Tensor) -> None:
        self._parts.setdefault(part, _Part()).sum_dot.append(dots(self.seed, start, values)[0])

    def report(self) -> list[pb.SumCheck]:
        return [
            pb.SumCheck(
                part=k,
                dot=math.fsum(p.dot),
                magnitude=math.fsum(p.magnitude),
                sum_dot=math.fsum(p.sum_dot),
                unit=self.unit,
                norm=math.sqrt(math.fsum(p.squares)),
            )
            for k, p in sorted(self._parts.items())
        ]
