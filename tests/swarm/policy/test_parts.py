"""A round's parts by water-filling (`swarm.policy.parts`): the closed form against the linear
program it solves, the issue's example, the cases that keep today's equal parts, and bounds that
match `split_parts` where the weights are equal."""

from __future__ import annotations

import itertools
import random

import pytest

from stage_server.averaging.flat import split_parts
from swarm.errors import InvalidArgument
from swarm.policy.parts import MAX_SHARE, Parts, part_bounds, round_time, water_fill

MBIT = 1e6 / 8  # bytes/s


def test_the_issues_example_one_slow_member_of_four_is_a_client_and_the_round_is_1_5x() -> None:
    rates = [10 * MBIT, 100 * MBIT, 100 * MBIT, 100 * MBIT]
    weights = water_fill(rates, 4)
    assert weights[0] == 0.0  # client mode: owns nothing
    assert weights[1:] == pytest.approx([1 / 3] * 3)
    v = 1e6 / 8  # one Mbit of vector: times in seconds per Mbit
    equal = round_time(rates, [], 4, v)
    filled = round_time(rates, weights, 4, v)
    assert equal == pytest.approx(0.15)
    assert filled == pytest.approx(0.10)
    assert equal / filled == pytest.approx(1.5)


@pytest.mark.parametrize(
    ("rates", "contributors"),
    [
        ([0.0, 5.0, 7.0], 3),  # one unknown
        ([3.0, 3.0, 3.0, 3.0, 3.0], 0),  # all equal
        ([1.0, 100.0], 2),  # two: the partition changes nothing
        ([0.0, 0.0, 0.0], 0),
    ],
)
def test_what_the_rates_cannot_tell_keeps_equal_parts_exactly(
    rates: list[float], contributors: int
) -> None:
    n = len(rates)
    assert water_fill(rates, contributors) == [1 / n] * n
    assert part_bounds(1000003, water_fill(rates, contributors)) == split_parts(1000003, n)


def _lp_bound(rates: list[float], m: int) -> float:
    """The least slowest-member time over a fine grid of partitions no weight of which passes
    the bound (brute force, n <= 4)."""
    n, steps, best = len(rates), 60, float("inf")
    for cut in itertools.product(range(steps + 1), repeat=n - 1):
        if sum(cut) > steps:
            continue
        weights = [c / steps for c in cut] + [(steps - sum(cut)) / steps]
        if max(weights) > MAX_SHARE / n + 1e-12:
            continue
        best = min(best, round_time(rates, weights, m, 1.0))
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("n", "m"), [(3, 3), (4, 4), (4, 3)])
def test_water_filling_is_no_slower_than_any_partition_of_a_fine_grid(
    seed: int, n: int, m: int
) -> None:
    rng = random.Random(seed)
    rates = [rng.choice([1.0, 10.0, 30.0, 100.0]) * rng.uniform(0.5, 2) for _ in range(n)]
    weights = water_fill(rates, m)
    assert sum(weights) == pytest.approx(1.0) and min(weights) >= 0
    assert round_time(rates, weights, m, 1.0) <= _lp_bound(rates, m) * (1 + 1e-9)


def test_the_slowest_members_traffic_falls_to_the_vector_at_eight() -> None:
    rates = [10.0] * 4 + [100.0] * 4
    weights = water_fill(rates, 8)
    assert weights[:4] == [0.0] * 4  # half slow: the slow half are clients
    assert round_time(rates, weights, 8, 1.0) == pytest.approx(0.1)
    assert round_time(rates, [], 8, 1.0) == pytest.approx((1 + 6 / 8) / 10)  # 1.75x


def test_an_aggregator_takes_parts_by_its_rate_and_sends_no_vector() -> None:
    rates = [100.0, 100.0, 100.0, 120.0]  # three contributors, one aggregator
    weights = water_fill(rates, 3)
    assert weights[3] > weights[0] > 0
    t = round_time(rates, weights, 3, 1.0)
    # Every member at the same level (no one idles while another is the bottleneck) ...
    assert (1 + weights[0]) / 100 == pytest.approx(t)
    assert 3 * weights[3] / 120 == pytest.approx(t)
    # ... and the aggregator makes the round faster than the three alone.
    assert t < round_time(rates[:3], water_fill(rates[:3], 3), 3, 1.0)
    # One fast enough would own everything; it owns the bound, 2/n, and the rest is shared.
    fast = water_fill([100.0, 100.0, 100.0, 1000.0], 3)
    assert fast[3] == MAX_SHARE / 4 and fast[:3] == pytest.approx([1 / 6] * 3)


@pytest.mark.attack("H-rates")
def test_no_rate_however_large_gives_a_member_more_than_the_bound() -> None:
    """A member announcing 1e12 B/s (or 1.7e308: its sums overflowed) owned the whole vector;
    now no weight passes MAX_SHARE / n, and the others share the rest by their rates."""
    for huge in (1e12, 1.7e308, 1e15):
        for m in (4, 2 + 1):  # a replica among four; an aggregator after three replicas
            rates = [10 * MBIT, 20 * MBIT, 30 * MBIT, huge]
            weights = water_fill(rates, m)
            assert max(weights) <= MAX_SHARE / 4 and sum(weights) == pytest.approx(1.0)
            assert weights[0] <= weights[1] <= weights[2] <= weights[3] == MAX_SHARE / 4
    eight = water_fill([10 * MBIT] * 3 + [1.7e308] * 8, 3)  # eight aggregators: no overflow
    assert max(eight) <= MAX_SHARE / 11 and sum(eight) == pytest.approx(1.0)


def test_two_contributors_and_an_aggregator_own_halves() -> None:
    assert water_fill([1.0, 2.0, 100.0], 2) == [0.5, 0.5, 0.0]
    assert water_fill([1.0, 100.0, 100.0], 1) == [1.0, 0.0, 0.0]


def test_members_that_must_not_own_are_clients_unless_no_one_else_could() -> None:
    relayed = water_fill([100.0, 100.0, 100.0, 100.0], clients={1})
    assert relayed[1] == 0 and relayed[0] == relayed[2] == relayed[3] == 1 / 3
    assert water_fill([5.0, 0.0, 7.0], clients={0}) == [0.0, 0.5, 0.5]  # unknown: equal
    assert water_fill([5.0, 9.0], clients={0}) == [0.0, 1.0]
    assert water_fill([5.0, 9.0], clients={0, 1}) == [0.5, 0.5]
    weights = water_fill([10.0, 100.0, 50.0, 100.0, 20.0], clients={3})
    assert weights[3] == 0 and sum(weights) == pytest.approx(1)
    assert weights[1] >= weights[2] > 0  # both at the bound, 2/4


def test_bad_rates_and_contributors_are_refused() -> None:
    with pytest.raises(InvalidArgument):
        water_fill([1.0, -1.0, 2.0])
    with pytest.raises(InvalidArgument):
        water_fill([1.0, float("nan"), 2.0])
    with pytest.raises(InvalidArgument):
        water_fill([1.0, 2.0], 3)


@pytest.mark.parametrize("numel", [0, 1, 7, 1000, 1000003])
def test_bounds_are_contiguous_cover_everything_and_follow_the_weights(numel: int) -> None:
    weights = [0.0, 0.5, 0.2, 0.3, 0.0]
    parts = part_bounds(numel, weights)
    assert len(parts) == 5 and parts[0].start == 0 and parts[-1].stop == numel
    assert all(a.stop == b.start for a, b in itertools.pairwise(parts))
    assert parts[0].stop == 0 and parts[4].start == parts[4].stop  # weight 0: empty
    for part, w in zip(parts, weights, strict=True):
        assert abs((part.stop - part.start) - w * numel) <= 1


def test_bounds_of_equal_or_no_weights_are_split_parts() -> None:
    for numel, n in [(0, 1), (1, 5), (10, 3), (1000003, 4)]:
        assert part_bounds(numel, [0.25] * n) == split_parts(numel, n)
        assert part_bounds(numel, [], n) == split_parts(numel, n)


def test_bad_weights_are_refused() -> None:
    for bad in ([0.0, 0.0], [1.0, -0.5], [float("inf"), 1.0], [float("nan"), 1.0]):
        with pytest.raises(InvalidArgument):
            part_bounds(10, bad)
    with pytest.raises(InvalidArgument):
        part_bounds(10, [])


def test_parts_are_one_value_checked_against_their_group() -> None:
    parts = Parts([0.0, 0.5, 0.5], 2)
    assert parts.weights == (0.0, 0.5, 0.5) and parts == Parts((0.0, 0.5, 0.5), 2)
    assert parts.check(3) == 2 and Parts().check(4) == 4  # 0 contributors: all of them
    assert parts.bounds(10, 3) == part_bounds(10, [0.0, 0.5, 0.5])
    with pytest.raises(InvalidArgument, match="3 part weights for a group of 2"):
        parts.check(2)
    with pytest.raises(InvalidArgument, match=r"contributors 4 outside 0\.\.3"):
        Parts((), 4).check(3)
