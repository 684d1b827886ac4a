"""The checksum of aggregators' sums (`scheduler.coordinator.trust.sum_checks`, the contributors'
side `stage_server.averaging.checksum`): no false alarm on honest float32 rounds (uneven parts,
slices that cut r's blocks, cancelling contributions, a wide range of magnitudes), a wrong sum
caught, and what is not judged (a lossy round, a part some contributor did not report, NaN
contributions: the commit's non-finite check has those)."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from scheduler.coordinator.trust.sum_checks import DOT_BLOCK, Mismatch, mismatches, tolerance
from stage_server.averaging.butterfly import RoundSettings, all_reduce
from stage_server.averaging.checksum import BLOCK, Draws, PartChecks, dots, sum_dots, weights
from stage_server.averaging.owner import Averager
from stage_server.averaging.summing import Reduced, Summer, sum_in_order
from swarm.policy.parts import Parts
from swarm.proto import stage_pb2 as pb
from swarm.wire.codec import CODEC_NONE, codec_from_name, decode, encode
from tests.support.pools import JOB, MiB, replicas

CONTRIBUTORS = 3
WEIGHTS = (0.1, 0.0, 0.25, 0.3, 0.35)  # 3 replicas (one a client), then 2 aggregators


def _contributions(seed: int, n: int) -> list[torch.Tensor]:
    """Float32 gradients over six orders of magnitude, the last cancelling the others' sum
    almost to nothing (where a relative check would be tightest)."""
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** (torch.rand(n, generator=g, dtype=torch.float64) * 6 - 3)
    xs = [(torch.randn(n, generator=g, dtype=torch.float64) * scale).float() for _ in range(2)]
    noise = torch.randn(n, generator=g) * 1e-6
    return [*xs, -(xs[0] + xs[1]) + noise]


def test_the_block_is_what_the_tolerance_counts_on() -> None:
    assert BLOCK == DOT_BLOCK


def test_r_is_splitmix64_bit_for_bit() -> None:
    """Every contributor must draw the same bits of r on any machine: the hash, redone in
    Python's integers, and exact float steps."""
    mask, seed = (1 << 64) - 1, 0x5EED_1234_ABCD
    expected = []
    for i in range(BLOCK - 3, BLOCK + 3):
        z = (seed + (i + 1) * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        expected.append((z >> 11) * 2.0**-52 - 1.0)
    assert weights(seed, BLOCK - 3, BLOCK + 3).tolist() == expected
    big = weights(seed, 0, 1 << 18)
    assert float(big.min()) >= -1.0 and float(big.max()) < 1.0
    assert float(big.mean()) == pytest.approx(0.0, abs=0.01)


def test_dots_do_not_depend_on_how_a_part_is_sliced() -> None:
    x = torch.randn(3 * BLOCK + 1234, dtype=torch.float64)
    whole = dots(7, 500, x)
    cuts = [0, 1, 4097, BLOCK - 500, BLOCK, 2 * BLOCK + 17, x.numel()]
    pieces = [dots(7, 500 + a, x[a:b]) for a, b in itertools.pairwise(cuts)]
    for k in range(3):
        assert math.fsum(p[k] for p in pieces) == pytest.approx(whole[k], rel=1e-12)
    assert dots(8, 500, x)[0] != pytest.approx(whole[0])  # another seed, another r


def test_r_kept_from_a_contribution_to_its_sum_is_the_r_drawn_anew() -> None:
    """`Draws`: r drawn once a round, kept from a slice's contribution to its sum (within its
    bytes; past them drawn again): the same bits either way, and the caller's values untouched
    (float64 values on the host are not copied by the conversion)."""
    x = torch.randn(2 * BLOCK + 77, dtype=torch.float64)
    s = torch.randn(x.numel(), dtype=torch.float64)
    before = x.clone()
    for limit in (0, BLOCK * 8, 1 << 30):  # nothing kept, one block kept, every block kept
        draws = Draws(5, limit_bytes=limit)
        assert dots(5, 300, x, draws) == dots(5, 300, x)
        assert draws.nbytes <= limit
        dot, squares = sum_dots(300, s, draws)
        r = weights(5, 300, 300 + s.numel())
        assert dot == pytest.approx(float(torch.dot(r, s)), rel=1e-12)
        assert squares == pytest.approx(float(torch.dot(s, s)), rel=1e-12)
        assert draws.nbytes == 0  # every kept block taken
    assert torch.equal(x, before)


@pytest.mark.parametrize("seed", range(40))
def test_an_honest_float32_sum_never_alarms(seed: int) -> None:
    """The owner's own summation (`Averager.summer`, sender order, float32) of cancelling
    contributions over a wide range: every contributor's r·S within the tolerance."""
    n = 1 + (seed * 7919) % (3 * BLOCK)  # lengths across r's blocks
    xs = _contributions(seed, n)
    reduced = Averager().summer([x.clone() for x in xs], [False] * 3, CODEC_NONE, 2048)
    start = seed * 1000
    reports = {}
    for j, x in enumerate(xs):
        checks = PartChecks(seed + 1)
        checks.contributed(4, start, x)
        checks.summed(4, start, reduced.tensor)
        reports[j] = checks.report()
    assert mismatches(reports, 3) == []


def _reports(
    sums: list[float], dots_: list[float], magnitude: float = 1.0
) -> dict[int, list[pb.SumCheck]]:
    return {
        j: [pb.SumCheck(part=3, dot=d, magnitude=magnitude, sum_dot=s, unit=2.0**-24, norm=1.0)]
        for j, (d, s) in enumerate(zip(dots_, sums, strict=True))
    }


def test_what_is_judged_and_what_is_not() -> None:
    allowed = tolerance(_reports([0.0], [0.0])[0] * 2, 2)
    assert 0 < allowed < 1e-4
    honest = _reports([3.0, 3.0], [1.0, 2.0])
    assert mismatches(honest, 2) == []
    wrong = _reports([3.0, 3.01], [1.0, 2.0])  # one member was answered another sum
    assert mismatches(wrong, 2) == [Mismatch(3, 1, 3.01, 3.0, allowed)]
    nan_sum = _reports([math.nan, 3.0], [1.0, 2.0])
    assert [m.contributor for m in mismatches(nan_sum, 2)] == [0]
    assert mismatches(_reports([math.nan] * 2, [math.nan, 2.0]), 2) == []  # the commit's
    one = _reports([3.01], [1.0])  # the other contributor did not report the part (lossy)
    assert mismatches({**one, 1: []}, 2) == []


def _off_by(honest: Summer, add: float) -> Summer:
    """`honest`'s sums, each element off by `add` (added to the first contribution, so that a
    lossy codec encodes the wrong sum as it would an honest one)."""

    def summer(
        values: list[torch.Tensor], owned: list[bool], codec: int, block_size: int
    ) -> Reduced:
        return honest([values[0] + add, *values[1:]], [True, *owned[1:]], codec, block_size)

    return summer


def _answering(lie: Callable[[torch.Tensor], torch.Tensor]) -> Summer:
    """An owner that sums honestly and answers `lie` of the sum, encoded as an honest one is."""

    def summer(
        values: list[torch.Tensor], owned: list[bool], codec: int, block_size: int
    ) -> Reduced:
        total = lie(sum_in_order(values, owned, CODEC_NONE, block_size).tensor)
        if codec == CODEC_NONE:
            return Reduced(total, None, total)
        msg = encode(total, "sum", codec, block_size)
        return Reduced(decode(msg), msg, total)

    return summer


async def _round(
    xs: list[torch.Tensor],
    seed: int,
    *,
    codec: int = CODEC_NONE,
    add: float = 0.0,
    lie: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[list[pb.SumCheck]]:
    """A real round of 3 replicas and 2 aggregators (PoolService servers) in uneven parts, slices
    of 40 kB (cutting r's blocks), every contributor's checksums; the aggregators' sums off by
    `add` an element, or `lie` of the sum."""
    async with replicas(5) as pool:
        for aggregator in pool[CONTRIBUTORS:]:
            honest = aggregator.averager.summer
            aggregator.averager.summer = _off_by(honest, add) if lie is None else _answering(lie)
        checks = [PartChecks(seed) for _ in range(CONTRIBUTORS)]
        results = await _all_reduce(
            pool,
            xs,
            checks,
            round=f"r{seed}",
            codec=codec,
            slice_bytes=40_000,
            parts=Parts(WEIGHTS, CONTRIBUTORS),
        )
    assert all(torch.equal(t, results[0]) for t in results)
    return [c.report() for c in checks]


async def _all_reduce(
    pool: list[Any], xs: list[torch.Tensor], checks: list[PartChecks], **settings: Any
) -> list[torch.Tensor]:
    """One round over `pool` (real PoolService servers), the first `len(xs)` contributing a
    copy of theirs (the second in place) with their `checks`."""
    group = [r.address for r in pool]
    return await asyncio.gather(
        *(
            all_reduce(
                x.clone(),
                RoundSettings(
                    group=group,
                    index=i,
                    job=JOB,
                    stage=0,
                    timeout_s=20.0,
                    chunk_bytes=MiB,
                    max_bytes=64 * MiB,
                    in_place=i == 1,
                    **settings,
                ),
                averager=r.averager,
                channels=r.channels,
                checks=checks[i],
            )
            for i, (r, x) in enumerate(zip(pool, xs, strict=False))
        )
    )


@pytest.mark.parametrize("seed", [1, 2])
async def test_an_honest_round_never_alarms_and_a_wrong_sum_is_caught(seed: int) -> None:
    xs = _contributions(seed, 150_000)
    honest = await _round(xs, seed)
    # every part's, the replicas' (0 and 2; 1 is a client's, empty) as the aggregators'
    assert [sorted(c.part for c in r) for r in honest] == [[0, 2, 3, 4]] * CONTRIBUTORS
    assert all(c.unit == 2.0**-24 for r in honest for c in r)
    assert mismatches(dict(enumerate(honest)), CONTRIBUTORS) == []
    # Gradients of unit scale, each sum off by 1e-3 an element (a float32 sum's rounding is
    # 1e-7 of that): caught at every member. How small an error is caught is relative to the
    # part's norm: one of 1e-3 among elements of up to 1e3 (`xs`) is within their rounding.
    g = torch.Generator().manual_seed(seed)
    unit = [torch.randn(150_000, generator=g) for _ in range(CONTRIBUTORS)]
    wrong = await _round(unit, seed, add=1e-3)
    found = mismatches(dict(enumerate(wrong)), CONTRIBUTORS)
    assert {(m.part, m.contributor) for m in found} == {(k, j) for k in (3, 4) for j in range(3)}


@pytest.mark.parametrize(("name", "add"), [("fp16", 1e-1), ("int8_blockwise", 1.0)])
async def test_a_lossy_round_is_checked_on_what_every_member_decodes(name: str, add: float) -> None:
    """Lossy averaging (issue 54): the contributions and the sum as decoded are checked, the
    codec's error of the sum allowed for: an honest round passes; an error a few times the
    codec's own (int8's step is about 0.05 here) does not."""
    reports = await _round(_contributions(3, 20_000), 3, codec=codec_from_name(name))
    assert [sorted(c.part for c in r) for r in reports] == [[0, 2, 3, 4]] * CONTRIBUTORS
    assert all(c.unit == 2.0**-24 and c.encoding > 0 for r in reports for c in r)
    assert mismatches(dict(enumerate(reports)), CONTRIBUTORS) == []
    g = torch.Generator().manual_seed(3)
    unit = [torch.randn(20_000, generator=g) for _ in range(CONTRIBUTORS)]
    wrong = await _round(unit, 3, add=add, codec=codec_from_name(name))
    assert len(mismatches(dict(enumerate(wrong)), CONTRIBUTORS)) == 2 * CONTRIBUTORS


def _direction(total: torch.Tensor) -> torch.Tensor:
    """A sum of the owner's choosing: a fixed direction of norm 1e4."""
    d = torch.randn(total.numel(), generator=torch.Generator().manual_seed(64))
    return (d * (1e4 / float(d.norm()))).to(total.dtype)


LIES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sign-flipped": lambda total: -total,
    "1e6 times": lambda total: total * 1e6,
    "a chosen direction": _direction,
}


@pytest.mark.attack("64-lossy")
@pytest.mark.parametrize("name", ["hadamard3", "fp16"])
async def test_a_lossy_sum_is_bounded_by_what_was_sent_not_by_itself(name: str) -> None:
    """Issue 64, item 1: the encoding's allowance was taken from the sum answered (hadamard3's:
    2‖S'‖, so any sum raised its own), and a sign-flipped sum, 1e6 times the sum or a direction
    of norm 1e4 passed every check with 0 mismatches. The allowance is now held to the
    contributions' norms, and x·S bounds ‖S' - Σ x‖ whatever r: each lie is caught at every
    contributor, for both aggregators' parts; an honest round of either codec still passes."""
    codec = codec_from_name(name)
    g = torch.Generator().manual_seed(5)
    unit = [torch.randn(20_000, generator=g) for _ in range(CONTRIBUTORS)]
    honest = await _round(unit, 5, codec=codec)
    assert mismatches(dict(enumerate(honest)), CONTRIBUTORS) == []
    assert (
        mismatches(dict(enumerate(await _round(_contributions(3, 20_000), 3, codec=codec))), 3)
        == []
    )
    for what, lie in LIES.items():
        reports = await _round(unit, 5, codec=codec, lie=lie)
        found = mismatches(dict(enumerate(reports)), CONTRIBUTORS)
        named = {(m.part, m.contributor) for m in found}
        assert named == {(k, j) for k in (3, 4) for j in range(CONTRIBUTORS)}, (what, found)


@pytest.mark.attack("H-checks")
async def test_a_replica_owner_who_knows_the_seed_is_caught_by_its_sum_s_norm() -> None:
    """Issue 54/55: a replica owner learns its stage's seed with its own PREPARE, so it can
    answer S + e with r·e = 0 for its own part, which no linear checksum sees (e of norm 1e3,
    the same to every member). Every part is checked now, a replica's too, and the sum's norm
    is held to the contributions' norms as the owner itself reports it summed them: caught at
    every contributor. Three replicas on real PoolService servers, equal parts."""
    seed, n = 11, 30_000
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    where = Parts((), 0).bounds(n, 3)[0]  # the liar's part: member 0's
    r = weights(seed, where.start, where.stop)
    e = torch.randn(where.stop - where.start, generator=torch.Generator().manual_seed(9)).double()
    e = (e - (r @ e) / (r @ r) * r) * (1e3 / float(e.norm()))  # r·e = 0, ‖e‖ = 1e3
    async with replicas(3) as pool:
        honest = pool[0].averager.summer

        def knowing(
            values: list[torch.Tensor], owned: list[bool], codec: int, block_size: int
        ) -> Reduced:
            reduced = honest(values, owned, codec, block_size)
            wrong = reduced.tensor + e.to(reduced.tensor.dtype)
            return Reduced(wrong, None, wrong)

        pool[0].averager.summer = knowing
        checks = [PartChecks(seed) for _ in pool]
        await _all_reduce(pool, xs, checks, round="known")
    reports = {j: c.report() for j, c in enumerate(checks)}
    found = mismatches(reports, 3)
    assert {(m.part, m.contributor, m.what) for m in found} == {(0, j, "‖S‖") for j in range(3)}
