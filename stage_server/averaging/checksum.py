"""A contributor's side of the linear checksum over every part of a round, an aggregator's or a
replica's (issue 43, item 4; issue 55; the coordinator's side, and why, is
`scheduler.coordinator.trust.sum_checks`).

Summation is linear: for any vector r, r·(Σ_j x_j) = Σ_j r·x_j. The coordinator sends the
replicas (never the aggregators) a secret seed with each PREPARE; each contributor j draws r from
it and reports, for every part, r·x_j over what it contributed, Σ_i |r_i·x_ji| and ‖x_j‖ (the
scales its roundings are bounded by), r·S and ‖S‖ over the sum it got back, and, of the part it
owns, each sender's squared norm as its averager summed it (`received`: the norm bound's
evidence) and its r·x and Σ|r·x| (`received_dots`, `received_magnitudes`: each contributor's
word about what it sent is held to them, `scheduler.coordinator.trust.sent_words`). An owner that
answers a sum S' ≠ S cannot make r·S' agree with the others' r·x without knowing r:
r·(S' - S) is spread over about ‖S' - S‖.

r_i is uniform in [-1, 1), a hash of the seed and i (an element's place in the flat vector:
splitmix64, in integers, then exact float64 steps), so every contributor draws the same bits of
r whatever its slices, its hardware or its torch (a generator's normals are not: their vectorised
and scalar paths round apart, and r must agree to the last bit). No copy of a whole part is made:
`BLOCK` elements of r and of the values (in float64, on the host) at a time. Drawing r is most of
the checksum's cost, so each block of it is drawn once a round, kept from the slice's
contribution to its sum (`Draws`, at most `KEEP_BYTES`), and in place (`weights`); and the sum's
Σ|r_i·S_i|, which nothing reads, is not taken (bench/checksum.py: the checksum at 0.62 of its
former cost, 1.55 times the unchecked round's reduce where it was 2.5 times, for 4M float32
values; the same r to the bit, so the same detection power).

Lossy codecs are checked too (issue 54): x_j is then what the contributor sent, decoded (what the
owner sums), and S the sum as every member decodes it. The owner's one encoding of the sum moves
it by a vector whose norm the contributor bounds from the decoded sum (`encoding_error`, reported
as `encoding`), which the coordinator's tolerance adds (`scheduler.coordinator.trust.sum_checks`): a
codec's rounding passes, an error past it does not. The bound reported is never what the
coordinator allows as such: it allows no more than the worst codec's share of the contributions'
norms (`swarm.wire.hadamard.ERROR_SHARE`), whatever sum the owner answers (issue 64). And since
that share is loose (a 3-bit codec may move a sum by its own norm), each contributor also reports
x·S, what it sent with the sum it took back (`sum_cross`): Σ_j x_j·S with ‖S‖ bound ‖S - Σ x‖,
which an owner's sign-flipped or scaled sum fails however r falls (`sum_checks`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from swarm.ops.totals import reported_sum
from swarm.proto import stage_pb2 as pb
from swarm.wire.codec import (
    CODEC_BF16,
    CODEC_FP16,
    CODEC_HADAMARD3,
    CODEC_INT8_BLOCKWISE,
    CODEC_NONE,
)
from swarm.wire.hadamard import ERROR_SHARE

__all__ = [
    "BLOCK",
    "AuditedChecks",
    "Draws",
    "PartChecks",
    "cross",
    "dots",
    "encoding_error",
    "received_dots",
    "sum_dots",
    "weights",
]

# The values are taken this many at a time (aligned: a block's dot is the same whatever the
# slices); a float64 dot over one block rounds by at most BLOCK·2^-53 of its magnitude (the
# coordinator's tolerance counts on it: `sum_checks`).
BLOCK = 1 << 16
# The most bytes of r a round keeps between a slice's contribution and its sum (`Draws`): a
# replica's own part is contributed whole before any of it is summed, the others' `window`
# slices at a time.
KEEP_BYTES = 64 << 20


_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def weights(seed: int, start: int, stop: int) -> torch.Tensor:
    """r over elements [start, stop) of the flat vector (float64, uniform in [-1, 1)): element
    i's is splitmix64's output for the seed's stream at i (uint64 arithmetic wraps, as it must).
    In place over one buffer and one scratch: a block's r is a dozen passes over 8 bytes an
    element, the checksum's largest cost, so no pass allocates another."""
    z = np.arange(start + 1, stop + 1, dtype=np.uint64)
    z *= _GAMMA
    z += np.uint64(seed)
    shifted = z >> np.uint64(30)
    z ^= shifted
    z *= _MIX1
    np.right_shift(z, np.uint64(27), out=shifted)
    z ^= shifted
    z *= _MIX2
    np.right_shift(z, np.uint64(31), out=shifted)
    z ^= shifted
    z >>= np.uint64(11)
    # The top 53 bits, exactly as a float64 in [0, 2), then shifted: every step is exact.
    r = z.astype(np.float64)
    r *= 2.0**-52
    r -= 1.0
    return torch.from_numpy(r)


def _blocks(
    start: int, values: torch.Tensor, *, own: bool
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """`values` (elements `start`.. of the flat vector) a block of r at a time: (pos, stop, the
    block's values in float64 on the host; `own`: a copy, even of float64 values there)."""
    pos, end = start, start + values.numel()
    while pos < end:
        stop = min(end, (pos // BLOCK + 1) * BLOCK)
        block = values[pos - start : stop - start]
        yield pos, stop, block.to(device="cpu", dtype=torch.float64, copy=own)
        pos = stop


def dots(
    seed: int, start: int, values: torch.Tensor, draws: Draws | None = None
) -> tuple[float, float, float]:
    """(r·values, Σ|r_i·values_i|, Σ values_i²), `values` being elements `start`.. of the flat
    vector (1-D, on any device), a block at a time; r from `draws` (kept there for the slice's
    sum, `sum_dots`) or drawn here."""
    dot: list[float] = []
    magnitude: list[float] = []
    squares: list[float] = []
    for pos, stop, x in _blocks(start, values, own=True):
        r = weights(seed, pos, stop) if draws is None else draws.keep(pos, stop)
        squares.append(float(torch.dot(x, x)))
        product = x.mul_(r)  # x is this call's own copy: r stays intact for `draws`
        dot.append(float(product.sum()))
        magnitude.append(float(product.abs_().sum()))
    return reported_sum(dot), reported_sum(magnitude), reported_sum(squares)


def sum_dots(start: int, values: torch.Tensor, draws: Draws) -> tuple[float, float]:
    """(r·values, Σ values_i²) of a sum taken back: r as `draws` kept it when the slice was
    contributed (drawn anew where it was not kept), and no Σ|r_i·values_i| (nothing reads it)."""
    dot: list[float] = []
    squares: list[float] = []
    for pos, stop, x in _blocks(start, values, own=False):
        r = draws.take(pos, stop)
        squares.append(float(torch.dot(x, x)))
        dot.append(float(torch.dot(r, x)))
    return reported_sum(dot), reported_sum(squares)


def received_dots(
    start: int, values: Sequence[torch.Tensor], draws: Draws
) -> list[tuple[float, float]]:
    """(r·x, Σ|r_i·x_i|) of each of `values` (each sender's contribution to elements `start`..
    of the flat vector, as its owner sums them), a block of r at a time and one block of one
    sender's values in float64 at a time: the owner's one more dot per element and sender, with
    r as its own contribution kept it (`Draws.peek`)."""
    dot: list[list[float]] = [[] for _ in values]
    magnitude: list[list[float]] = [[] for _ in values]
    for blocks in zip(*(_blocks(start, v, own=True) for v in values), strict=True):
        r = draws.peek(blocks[0][0], blocks[0][1])
        for i, (_, _, x) in enumerate(blocks):
            product = x.mul_(r)  # x is a copy of its own: r stays intact
            dot[i].append(float(product.sum()))
            magnitude[i].append(float(product.abs_().sum()))
    return [(reported_sum(d), reported_sum(a)) for d, a in zip(dot, magnitude, strict=True)]


class Draws:
    """One round's r, each block kept from its slice's contribution to its sum (bounded by
    `limit_bytes`; past it a block is drawn again when the sum comes): r is then drawn once an
    element a round, not twice. Called from several threads (`asyncio.to_thread`)."""

    def __init__(self, seed: int, limit_bytes: int = KEEP_BYTES) -> None:
        self.seed, self.limit_bytes, self.nbytes = seed, limit_bytes, 0
        self._kept: dict[tuple[int, int], torch.Tensor] = {}
        self._lock = threading.Lock()

    def keep(self, pos: int, stop: int) -> torch.Tensor:
        """r over [pos, stop), drawn now and kept for `take` while there is room."""
        r = weights(self.seed, pos, stop)
        with self._lock:
            if self.nbytes + r.nbytes <= self.limit_bytes and (pos, stop) not in self._kept:
                self._kept[(pos, stop)] = r
                self.nbytes += r.nbytes
        return r

    def peek(self, pos: int, stop: int) -> torch.Tensor:
        """r over [pos, stop), as kept (and kept on, for `take`), or drawn again."""
        with self._lock:
            r = self._kept.get((pos, stop))
        return weights(self.seed, pos, stop) if r is None else r

    def take(self, pos: int, stop: int) -> torch.Tensor:
        """r over [pos, stop), as kept (and let go of), or drawn again."""
        with self._lock:
            r = self._kept.pop((pos, stop), None)
            if r is not None:
                self.nbytes -= r.nbytes
        return weights(self.seed, pos, stop) if r is None else r


def cross(sent: torch.Tensor, summed: torch.Tensor) -> float:
    """x·S of a slice (1-D, as long): float64 products, `BLOCK` at a time (a block's dot rounds
    by at most BLOCK·2^-53 of Σ|x_i·S_i|, which `sum_checks` allows)."""
    out: list[float] = []
    pairs = zip(_blocks(0, sent, own=False), _blocks(0, summed, own=False), strict=True)
    for (_, _, x), (_, _, s) in pairs:
        out.append(float(torch.dot(x, s)))
    return reported_sum(out)


def encoding_error(codec: int, block_size: int, decoded: torch.Tensor) -> float:
    """A bound on ‖decoded - S‖₂, the error of one encoding of a sum S whose decoding is
    `decoded` (a whole part, 1-D): fp16 and bf16 round each element by at most half their unit
    of it; int8_blockwise by half a step, absmax/254, in each block of `block_size`; hadamard3's
    8 levels (clipped past 2.15 of a block's rms; its rotation keeps norms) to `ERROR_SHARE` of
    the norm. A margin of 1 % covers the decoded values standing for the exact ones."""
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
        return ERROR_SHARE * norm
    raise ValueError(f"no error bound for codec {codec}")


@dataclass
class _Part:
    dot: list[float] = field(default_factory=list)
    magnitude: list[float] = field(default_factory=list)
    squares: list[float] = field(default_factory=list)
    sum_dot: list[float] = field(default_factory=list)
    sum_squares: list[float] = field(default_factory=list)
    encoding: list[float] = field(default_factory=list)  # squared bounds, a slice each
    cross: list[float] = field(default_factory=list)  # x·S, a slice each (lossy rounds)


class PartChecks:
    """One contributor's checksums of one round (seed `seed`), slice by slice: `contributed`
    before a slice's values are sent (and overwritten by its sum), `summed` once its sum is in
    place; `report()` gives one `SumCheck` per part, with the unit roundoff of the values' dtype
    (the owner sums in it)."""

    def __init__(self, seed: int) -> None:
        self.seed, self.unit = seed, 0.0
        self.draws = Draws(seed)  # r drawn once an element: kept from contributed to summed
        self.codec, self.block_size = CODEC_NONE, 0  # a lossy round's codec, once `lossy`
        self.crossing = False  # whether x·S is taken (`lossy`)
        # (part, start) -> a lossy slice's contribution, a copy on the host, until its sum
        # comes (`cross`: the sum lands over the values sent)
        self._sent: dict[tuple[int, int], torch.Tensor] = {}
        self._parts: dict[int, _Part] = {}
        # of the part it owns: each sender's squared norm it summed (`SumCheck.received`)
        self.received: dict[int, list[float]] = {}
        # ... and each sender's (r·x, Σ|r·x|), a slice at a time (`received_dots`)
        self._words: dict[int, list[list[tuple[float, float]]]] = {}

    def lossy(self, codec: int, block_size: int, *, crossing: bool = True) -> None:
        """The round's parts travel encoded: the values checked are the decoded ones, and the
        sum's one encoding is allowed for (`encoding_error`; a lossy part is one slice), and
        held to x·S (`crossing`: an audit seed's checks leave it to the round's)."""
        self.codec, self.block_size, self.crossing = codec, block_size, crossing

    def contributed(self, part: int, start: int, values: torch.Tensor) -> None:
        if values.dtype.is_floating_point:
            self.unit = max(self.unit, torch.finfo(values.dtype).eps / 2)
        if self.crossing:  # a copy: the sum lands over `values`, or the averager sums into it
            self._sent[(part, start)] = values.detach().to(device="cpu", copy=True).reshape(-1)
        dot, magnitude, squares = dots(self.seed, start, values, self.draws)
        p = self._parts.setdefault(part, _Part())
        p.dot.append(dot)
        p.magnitude.append(magnitude)
        p.squares.append(squares)

    def summing(self, part: int, start: int, values: Sequence[torch.Tensor]) -> None:
        """Its own part's slice at `start` is about to be summed from `values` (each sender's,
        in sender order): its words about what each sent (`SumCheck.received_dots`)."""
        self._words.setdefault(part, []).append(received_dots(start, values, self.draws))

    def summed(self, part: int, start: int, values: torch.Tensor) -> None:
        p = self._parts.setdefault(part, _Part())
        dot, squares = sum_dots(start, values, self.draws)
        p.sum_dot.append(dot)
        p.sum_squares.append(squares)
        p.encoding.append(encoding_error(self.codec, self.block_size, values) ** 2)
        sent = self._sent.pop((part, start), None)
        if self.crossing:  # a slice whose contribution was not seen: no x·S to report
            p.cross.append(math.nan if sent is None else cross(sent, values))

    def report(self) -> list[pb.SumCheck]:
        return [
            pb.SumCheck(
                part=k,
                dot=reported_sum(p.dot),
                magnitude=reported_sum(p.magnitude),
                sum_dot=reported_sum(p.sum_dot),
                unit=self.unit,
                norm=math.sqrt(reported_sum(p.squares)),
                encoding=math.sqrt(reported_sum(p.encoding)),
                sum_cross=reported_sum(p.cross),
                received=self.received.get(k, []),
                sum_norm=math.sqrt(reported_sum(p.sum_squares)),
                received_dots=[reported_sum(d) for d, _ in self._said(k)],
                received_magnitudes=[reported_sum(a) for _, a in self._said(k)],
            )
            for k, p in sorted(self._parts.items())
        ]

    def _said(self, part: int) -> list[tuple[list[float], list[float]]]:
        """Per sender, the r·x and Σ|r·x| of each slice of `part` it summed from that sender."""
        slices = self._words.get(part, [])
        senders = len(slices[0]) if slices else 0
        if any(len(words) != senders for words in slices):
            return []  # slices of rounds of another size: none said
        return [([w[i][0] for w in slices], [w[i][1] for w in slices]) for i in range(senders)]


class AuditedChecks(PartChecks):
    """The round's checksums, and the same of every slice with each seed of `audit_seeds`: other
    contributors' contributions are audited (issue 55), and this replica's reports, with the
    others', give each one's r·x without a word from it
    (`scheduler.coordinator.trust.contributions`)."""

    def __init__(self, seed: int, audit_seeds: Sequence[int]) -> None:
        super().__init__(seed)
        self.audits = [PartChecks(s) for s in audit_seeds]

    def lossy(self, codec: int, block_size: int, *, crossing: bool = True) -> None:
        super().lossy(codec, block_size, crossing=crossing)
        for a in self.audits:
            a.lossy(codec, block_size, crossing=False)  # x·S is the same under every seed

    def contributed(self, part: int, start: int, values: torch.Tensor) -> None:
        super().contributed(part, start, values)
        for a in self.audits:
            a.contributed(part, start, values)

    def summing(self, part: int, start: int, values: Sequence[torch.Tensor]) -> None:
        super().summing(part, start, values)
        for a in self.audits:
            a.summing(part, start, values)

    def summed(self, part: int, start: int, values: torch.Tensor) -> None:
        super().summed(part, start, values)
        for a in self.audits:
            a.summed(part, start, values)

    def audit_report(self) -> list[pb.SumCheck]:
        """Each audit seed's checksums, with its place among them (`seed_index`)."""
        out = []
        for i, a in enumerate(self.audits):
            for check in a.report():
                check.seed_index = i
                out.append(check)
        return out
