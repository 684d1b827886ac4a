"""Placement: bottleneck arithmetic, the joining peer's stage, and `place` against brute force."""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence

import pytest

from swarm.policy.placement import (
    best_stage,
    bottleneck,
    place,
    place_new,
    stage_totals,
    stages_without_replicas,
    upper_bound,
)

KINDS = ("same_hardware", "noisy", "unrelated", "discrete")


def instance(kind: str, rng: random.Random, peers: int, stages: int) -> dict[str, list[float]]:
    """Peers of different speeds on stages of different cost (seconds per sample on a reference
    device). `same_hardware`: a peer's speed is its power over the stage's cost, so every peer
    ranks the stages alike; `noisy`: the same, +-30% per stage (memory, kernels); `unrelated`:
    any speed anywhere; `discrete`: few distinct values, hence many exact ties."""
    costs = [rng.uniform(0.5, 2.0) for _ in range(stages)]
    speeds = {}
    for i in range(peers):
        power = rng.lognormvariate(0.0, 0.7)
        if kind == "same_hardware":
            row = [power / c for c in costs]
        elif kind == "noisy":
            row = [power / c * rng.uniform(0.7, 1.3) for c in costs]
        elif kind == "unrelated":
            row = [rng.uniform(0.1, 10.0) for _ in costs]
        else:
            row = [rng.choice([1.0, 2.0, 4.0]) / rng.choice([1.0, 2.0, 3.0]) for _ in costs]
        speeds[f"peer-{i:02d}"] = row
    return speeds


def optimum(speeds: Mapping[str, Sequence[float]], stages: int) -> float:
    rows = list(speeds.values())
    best = 0.0
    for combo in itertools.product(range(stages), repeat=len(rows)):
        totals = [0.0] * stages
        for row, stage in zip(rows, combo, strict=True):
            totals[stage] += row[stage]
        best = max(best, min(totals))
    return best


# -- arithmetic ------------------------------------------------------------------------------------


def test_bottleneck_is_the_weakest_stage_total() -> None:
    speeds = {"a": [4.0, 1.0, 1.0], "b": [1.0, 3.0, 1.0], "c": [1.0, 2.0, 1.0]}
    assignment = {"a": 0, "b": 1, "c": 1}
    assert stage_totals(assignment, speeds, 3) == [4.0, 5.0, 0.0]
    assert bottleneck(assignment, speeds, 3) == 0.0  # stage 2 has no replica
    assert stages_without_replicas(assignment, 3) == [2]
    assignment["c"] = 2
    assert bottleneck(assignment, speeds, 3) == 1.0
    assert stages_without_replicas(assignment, 3) == []
    with pytest.raises(ValueError):
        bottleneck(assignment, speeds, 0)


# -- a joining peer --------------------------------------------------------------------------------


def test_best_stage_raises_the_bottleneck() -> None:
    assert best_stage([1.0, 1.0, 1.0], [5.0, 3.0, 8.0]) == 1
    # Much faster elsewhere, but only stage 1 holds the job back.
    assert best_stage([10.0, 0.2, 10.0], [5.0, 3.0, 3.5]) == 1
    # Stage 1 gains most from it, but stage 2 is nearly as weak: 3.5 after either, so the rest
    # decides. Going to stage 2 leaves min(5, 3, 3.6) = 3; going to 1 gives min(5, 4, 3.5) = 3.5.
    assert best_stage([0.1, 1.0, 0.1], [5.0, 3.0, 3.5]) == 1


def test_best_stage_ties() -> None:
    # Two stages share the bottleneck: no single peer raises it. It goes to the weakest stage,
    # then where it is fastest, then to the lowest index.
    assert best_stage([1.0, 2.0, 5.0], [3.0, 3.0, 10.0]) == 1
    assert best_stage([2.0, 2.0, 5.0], [3.0, 3.0, 10.0]) == 0
    assert best_stage([1.0, 1.0, 1.0], [3.0, 2.0, 3.0]) == 1
    # A stage it cannot serve (speed 0) is never chosen, even the empty one.
    assert best_stage([0.0, 1.0, 1.0], [0.0, 5.0, 5.0]) == 1
    with pytest.raises(ValueError, match="cannot serve"):
        best_stage([0.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="one per stage"):
        best_stage([1.0], [1.0, 1.0])


def test_best_stage_is_the_best_single_placement() -> None:
    rng = random.Random(3)
    for _ in range(500):
        stages = rng.randint(1, 6)
        totals = [rng.choice([0.0, rng.uniform(0.0, 10.0)]) for _ in range(stages)]
        peer = [rng.uniform(0.0, 5.0) for _ in range(stages)]
        after = [
            min(t + (peer[j] if j == k else 0.0) for j, t in enumerate(totals))
            for k in range(stages)
        ]
        chosen = best_stage(peer, totals)
        assert after[chosen] == pytest.approx(max(after), rel=1e-9)


def test_peers_joining_a_running_job_go_fastest_first() -> None:
    # Stages at 5 and 3. In name order slow "a" would take stage 1 (4), then fast "b" too: 5 and
    # 8, a bottleneck of 5. Fastest first, "b" lifts stage 1 to 7 and "a" joins stage 0: 6.
    speeds = {"a": [1.0, 1.0], "b": [4.0, 4.0]}
    assert place_new(speeds, 2, [5.0, 3.0]) == {"a": 0, "b": 1}
    # One joining peer: its `best_stage`. Peers that can serve nothing are left out.
    assert place_new({"c": [1.0, 2.0, 0.5]}, 3, [5.0, 3.0, 8.0]) == {"c": 1}
    assert place_new({"idle": [0.0, 0.0]}, 2, [1.0, 1.0]) == {}
    with pytest.raises(ValueError, match="one per stage"):
        place_new({"a": [1.0, 1.0]}, 2, [1.0])


def test_a_job_nobody_serves_is_placed_whole() -> None:
    speeds = instance("noisy", random.Random(4), 12, 3)
    assert place_new(speeds, 3) == place(speeds, 3)


# -- planning a set of peers -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_every_stage_gets_a_replica(kind: str) -> None:
    rng = random.Random(11)
    for _ in range(50):
        stages = rng.randint(1, 8)
        speeds = instance(kind, rng, rng.randint(stages, 2 * stages), stages)
        assignment = place(speeds, stages)
        assert stages_without_replicas(assignment, stages) == []
        assert sorted(assignment) == sorted(speeds)


def test_cover_respects_what_peers_can_serve() -> None:
    # Only "c" can serve stage 2, and "c" is also the fastest on stage 0: it must go to 2.
    speeds = {"a": [1.0, 1.0, 0.0], "b": [1.0, 1.0, 0.0], "c": [9.0, 9.0, 1.0]}
    assert place(speeds, 3)["c"] == 2
    assert stages_without_replicas(place(speeds, 3), 3) == []


def test_too_few_peers_gives_a_partial_placement() -> None:
    speeds = {"a": [5.0, 1.0, 1.0, 1.0], "b": [5.0, 4.0, 1.0, 1.0], "idle": [0.0, 0.0, 0.0, 0.0]}
    assignment = place(speeds, 4)
    assert assignment == {"a": 0, "b": 1}  # one stage each; "idle" can serve nothing
    assert stages_without_replicas(assignment, 4) == [2, 3]
    assert place({}, 2) == {}


# -- min_replicas: redundancy before throughput --------------------------------------------------


def _sizes(assignment: Mapping[str, int], stages: int) -> list[int]:
    return [sum(1 for k in assignment.values() if k == stage) for stage in range(stages)]


def test_min_replicas_fills_every_stage_before_adding_throughput() -> None:
    # Eight servers for four stages, two of them three times as fast: for throughput alone the
    # fast ones serve a stage each and the slow ones pile up on the other two (1/1/3/3: one
    # loss there rolls the job back). With min_replicas = 2 every stage gets two.
    speeds = {"fast-0": [30.0] * 4, "fast-1": [30.0] * 4}
    speeds |= {f"slow-{i}": [10.0] * 4 for i in range(6)}
    assert sorted(_sizes(place(speeds, 4), 4)) == [1, 1, 3, 3]
    two = place(speeds, 4, min_replicas=2)
    assert _sizes(two, 4) == [2, 2, 2, 2] and sorted(two) == sorted(speeds)
    # ... and the best such placement: each fast peer beside a slow one, the rest in pairs.
    assert bottleneck(two, speeds, 4) == 20.0
    assert place(speeds, 4, min_replicas=2) == two  # a function of its input
    assert place_new(speeds, 4, min_replicas=2) == two


def test_the_readmes_six_servers_on_four_stages() -> None:
    # README: tiny.toml's 4 stages (the last the costliest: the head), 6 equal servers, "2
    # spares". Two stages get a second replica either way; with min_replicas = 2 the two
    # servers short of it (`swarm status` names them) are 2, not a placement that looks done.
    speeds = {f"peer-{i}": [10.0, 10.0, 10.0, 7.75] for i in range(6)}
    for m in (1, 2):
        assert sorted(_sizes(place(speeds, 4, min_replicas=m), 4)) == [1, 1, 2, 2]
    eight = {f"peer-{i}": [10.0, 10.0, 10.0, 7.75] for i in range(8)}
    assert _sizes(place(eight, 4, min_replicas=2), 4) == [2, 2, 2, 2]
    # Three replicas asked of 8 servers: two each, and no stage a third before all have one.
    assert _sizes(place(eight, 4, min_replicas=3), 4) == [2, 2, 2, 2]


@pytest.mark.parametrize("kind", KINDS)
def test_min_replicas_holds_whenever_the_peers_allow(kind: str) -> None:
    rng = random.Random(21)
    for _ in range(40):
        stages, m = rng.randint(1, 5), rng.randint(1, 3)
        count = rng.randint(stages, (m + 1) * stages)
        speeds = instance(kind, rng, count, stages)
        sizes = _sizes(place(speeds, stages, min_replicas=m), stages)
        # Every stage m replicas when there are enough peers; else no stage more than
        # one above another (the short ones are filled first, round by round).
        if count >= m * stages:
            assert min(sizes) >= m, (sizes, m)
        else:
            assert max(sizes) <= m and max(sizes) - min(sizes) <= 1, (sizes, m)


def test_min_replicas_respects_what_peers_can_serve() -> None:
    # Only "c" and "d" can serve stage 2: each second round must use the other one there.
    speeds = {
        "a": [1.0, 1.0, 0.0],
        "b": [1.0, 1.0, 0.0],
        "e": [1.0, 1.0, 0.0],
        "f": [1.0, 1.0, 0.0],
        "c": [9.0, 9.0, 1.0],
        "d": [9.0, 9.0, 1.0],
    }
    placed = place(speeds, 3, min_replicas=2)
    assert _sizes(placed, 3) == [2, 2, 2] and placed["c"] == placed["d"] == 2


def test_peers_joining_a_running_job_fill_stages_short_of_min_replicas_first() -> None:
    # Stage 0 is the bottleneck (5), but stage 1 has one replica of min_replicas = 2.
    speeds = {"a": [4.0, 4.0, 4.0]}
    now, sizes = [5.0, 20.0, 9.0], [2, 1, 2]
    assert place_new(speeds, 3, now) == {"a": 0}
    assert place_new(speeds, 3, now, min_replicas=2, sizes=sizes) == {"a": 1}
    # Two joining: the second goes where it raises the bottleneck once every stage has two.
    two = {"a": [4.0, 4.0, 4.0], "b": [3.0, 3.0, 3.0]}
    assert place_new(two, 3, now, min_replicas=2, sizes=sizes) == {"a": 1, "b": 0}
    # A peer that cannot serve the short stage joins where it can.
    assert place_new({"c": [4.0, 0.0, 4.0]}, 3, now, min_replicas=2, sizes=sizes) == {"c": 0}
    with pytest.raises(ValueError, match="min_replicas=0"):
        place_new(speeds, 3, now, min_replicas=0, sizes=sizes)


def test_one_peer_per_stage_is_optimal() -> None:
    rng = random.Random(5)
    for kind in KINDS:
        for _ in range(50):
            speeds = instance(kind, rng, 4, 4)
            assert bottleneck(place(speeds, 4), speeds, 4) == pytest.approx(optimum(speeds, 4))


@pytest.mark.parametrize("kind", KINDS)
def test_matches_brute_force_on_small_jobs(kind: str) -> None:
    """3 to 7 peers on 3 stages, 150 instances per kind: every one optimal. (Over 1,000 seeds per
    kind one `noisy` instance of 4,000 fell short, at 0.987 of the optimum.)"""
    for seed in range(150):
        rng = random.Random(seed)
        speeds = instance(kind, rng, rng.randint(3, 7), 3)
        got = bottleneck(place(speeds, 3), speeds, 3)
        assert got == pytest.approx(optimum(speeds, 3), rel=1e-9), seed


@pytest.mark.parametrize("kind", KINDS)
def test_large_jobs_come_close_to_the_upper_bound(kind: str) -> None:
    """300 peers, 12 stages: brute force is out of reach, so compare with the fractional bound
    (itself possibly above the optimum). Measured over seeds 0-5: 0.965 to 1.0 of it."""
    rng = random.Random(2)
    speeds = instance(kind, rng, 300, 12)
    assignment = place(speeds, 12)
    assert bottleneck(assignment, speeds, 12) >= 0.95 * upper_bound(speeds, 12)


def test_output_depends_only_on_the_input() -> None:
    rng = random.Random(9)
    speeds = instance("noisy", rng, 40, 5)
    first = place(speeds, 5)
    shuffled = list(speeds.items())
    random.Random(1).shuffle(shuffled)
    assert place(dict(shuffled), 5) == first
    assert place({p: list(row) for p, row in speeds.items()}, 5) == first
    assert list(first) == sorted(first)


def test_rejects_bad_speeds() -> None:
    with pytest.raises(ValueError, match="one per stage"):
        place({"a": [1.0, 2.0]}, 3)
    with pytest.raises(ValueError, match="finite"):
        place({"a": [1.0, float("nan")]}, 2)
    with pytest.raises(ValueError):
        place({"a": [1.0, -1.0]}, 2)
    with pytest.raises(ValueError):
        place({"a": [1.0]}, 0)
