"""A contributor's side of the linear checksum over every part of a round, an aggregator's or a
replica's (issue 43, item 4; issue 55; the coordinator's side, and why, is
`scheduler.coordinator.sum_checks`).

Summation is linear: for any vector r, r·(Σ_j x_j) = Σ_j r·x_j. The coordinator sends the
replicas (never the aggregators) a secret seed with each PREPARE; each contributor j draws r from
it and reports, for every part, r·x_j over what it contributed, Σ_i |r_i·x_ji| and ‖x_j‖ (the
scales its roundings are bounded by), r·S and ‖S‖ over the sum it got back, and, of the part it
owns, each sender's squared norm as its averager summed it (`received`: the norm bound's
evidence). An owner that answers a sum S' ≠ S cannot make r·S' agree with the others' r·x
without knowing r: r·(S' - S) is spread over about ‖S' - S‖.

r_i is uniform in [-1, 1), a hash of the seed and i (an element's place in the flat vector:
splitmix64, in integers, then exact float64 steps), so every contributor draws the same bits of
r whatever its slices, its hardware or its torch (a generator's normals are not: their vectorised
and scalar paths round apart, and r must agree to the last bit). No copy of a whole part is made:
`BLOCK` elements of r and of the values (in float64, on the host) at a time.

Lossy codecs are checked too (issue 54): x_j is then what the contributor sent, decoded (what the
owner sums), and S the sum as every member decodes it. The owner's one encoding of the sum moves
it by a vector whose norm the contributor bounds from the decoded sum (`encoding_error`, reported
as `encoding`), which the coordinator's tolerance adds (`scheduler.coordinator.sum_checks`): a
codec's rounding passes, an error past it does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from swarm.proto import stage_pb2 as pb
from swarm.wire.codec import (
    CODEC_BF16,
    CODEC_FP16,
    CODEC_HADAMARD3,
    CODEC_INT8_BLOCKWISE,
    CODEC_NONE,
)

__all__ = ["BLOCK", "PartChecks", "dots", "encoding_error", "weights"]

# The values are taken this many at a time (aligned: a block's dot is the same whatever the
# slices); a float64 dot over one block rounds by at most BLOCK·2^-53 of its magnitude (the
# coordinator's tolerance counts on it: `sum_checks`).
BLOCK = 1 << 16


_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def weights(seed: int, start: int, stop: int) -> torch.Tensor:
    """r over elements [start, stop) of the flat vector (float64, uniform in [-1, 1)): element
    i's is splitmix64's output for the seed's stream at i (uint64 arithmetic wraps, as it must)."""
    z = np.uint64(seed) + (np.arange(start, stop, dtype=np.uint64) + np.uint64(1)) * _GAMMA
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z ^= z >> np.uint64(31)
    # The top 53 bits, exactly as a float64 in [0, 2), then shifted: every step is exact.
    return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) * 2.0**-52 - 1.0)


def dots(seed: int, start: int, values: torch.Tensor) -> tuple[float, float, float]:
    """(r·values, Σ|r_i·values_i|, Σ values_i²), `values` being elements `start`.. of the flat
    vector (1-D, on any device), a block at a time."""
    dot: list[float] = []
    magnitude: list[float] = []
    squares: list[float] = []
    pos, end = start, start + values.numel()
    while pos < end:
        stop = min(end, (pos // BLOCK + 1) * BLOCK)
        r = weights(seed, pos, stop)
        x = values[pos - start : stop - start].to(device="cpu", dtype=torch.float64)
        squares.append(float(torch.dot(x, x)))
        product = r.mul_(x)  # r is this call's own: no second buffer
        dot.append(float(product.sum()))
        magnitude.append(float(product.abs_().sum()))
        pos = stop
    return math.fsum(dot), math.fsum(magnitude), math.fsum(squares)


def encoding_error(codec: int, block_size: int, decoded: torch.Tensor) -> float:
    """A bound on ‖decoded - S‖₂, the error of one encoding of a sum S whose decoding is
    `decoded` (a whole part, 1-D): fp16 and bf16 round each element by at most half their unit
    of it; int8_blockwise by half a step, absmax/254, in each block of `block_size`; hadamard3's
    8 levels (clipped past 2.15 of a block's rms; its rotation keeps norms) are held to twice the
    norm. A margin of 1 % covers the decoded values standing for the exact ones."""
    x = decoded.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
    norm = float(torch.linalg.vector_norm(x))
    if codec == CODEC_NONE:
        return 0.0
    if codec == CODEC_FP16:
        return 1.01 * 2.0**-11 * norm
    if codec == CODEC_BF16:
        return 1.01 * 2.0**-8 * norm
    if codec == CODEC_INT8_BLOCKWISE:
        squares = 0.0
        for start in range(0, x.numel(), max(block_size, 1)):
            block = x[start : start + block_size]
            squares += block.numel() * (float(block.abs().max()) / 254) ** 2
        return 1.01 * math.sqrt(squares)
    if codec == CODEC_HADAMARD3:
        return 2.0 * norm
    raise ValueError(f"no error bound for codec {codec}")


@dataclass
class _Part:
    dot: list[float] = field(default_factory=list)
    magnitude: list[float] = field(default_factory=list)
    squares: list[float] = field(default_factory=list)
    sum_dot: list[float] = field(default_factory=list)
    sum_squares: list[float] = field(default_factory=list)
    encoding: list[float] = field(default_factory=list)  # squared bounds, a slice each


class PartChecks:
    """One contributor's checksums of one round (seed `seed`), slice by slice: `contributed`
    before a slice's values are sent (and overwritten by its sum), `summed` once its sum is in
    place; `report()` gives one `SumCheck` per part, with the unit roundoff of the values' dtype
    (the owner sums in it)."""

    def __init__(self, seed: int) -> None:
        self.seed, self.unit = seed, 0.0
        self.codec, self.block_size = CODEC_NONE, 0  # a lossy round's codec, once `lossy`
        self._parts: dict[int, _Part] = {}
        # of the part it owns: each sender's squared norm it summed (`SumCheck.received`)
        self.received: dict[int, list[float]] = {}

    def lossy(self, codec: int, block_size: int) -> None:
        """The round's parts travel encoded: the values checked are the decoded ones, and the
        sum's one encoding is allowed for (`encoding_error`; a lossy part is one slice)."""
        self.codec, self.block_size = codec, block_size

    def contributed(self, part: int, start: int, values: torch.Tensor) -> None:
        if values.dtype.is_floating_point:
            self.unit = max(self.unit, torch.finfo(values.dtype).eps / 2)
        dot, magnitude, squares = dots(self.seed, start, values)
        p = self._parts.setdefault(part, _Part())
        p.dot.append(dot)
        p.magnitude.append(magnitude)
        p.squares.append(squares)

    def summed(self, part: int, start: int, values: torch.Tensor) -> None:
        p = self._parts.setdefault(part, _Part())
        dot, _, squares = dots(self.seed, start, values)
        p.sum_dot.append(dot)
        p.sum_squares.append(squares)
        p.encoding.append(encoding_error(self.codec, self.block_size, values) ** 2)

    def report(self) -> list[pb.SumCheck]:
        return [
            pb.SumCheck(
                part=k,
                dot=math.fsum(p.dot),
                magnitude=math.fsum(p.magnitude),
                sum_dot=math.fsum(p.sum_dot),
                unit=self.unit,
                norm=math.sqrt(math.fsum(p.squares)),
                encoding=math.sqrt(math.fsum(p.encoding)),
                received=self.received.get(k, []),
                sum_norm=math.sqrt(math.fsum(p.sum_squares)),
            )
            for k, p in sorted(self._parts.items())
        ]
