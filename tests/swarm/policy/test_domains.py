"""Failure domains (`swarm.policy.domains`): placement, joining peers and rebalancing spread a
stage's replicas over distinct hosts, then routers, where that costs little throughput, and the
stages they cannot spread are named."""

from __future__ import annotations

import random

from swarm.policy.domains import SPREAD_SLACK, Domains, crowded, crowding, move_crowding, spread
from swarm.policy.placement import bottleneck, place, place_new
from swarm.policy.rebalance import RebalanceConfig, plan_move, plan_refill

# Two machines at one home (one router), one at a friend's.
HOME = {
    "a": Domains("box1", "203.0.113.7"),
    "b": Domains("box2", "203.0.113.7"),
    "c": Domains("box1", "203.0.113.7"),
    "d": Domains("box2", "203.0.113.7"),
}


def _stages(assignment: dict[str, int], num_stages: int) -> list[list[str]]:
    members: list[list[str]] = [[] for _ in range(num_stages)]
    for peer, stage in sorted(assignment.items()):
        members[stage].append(peer)
    return members


def test_crowding_counts_replicas_beyond_the_first_per_domain_and_unknown_ones_share_nothing() -> (
    None
):
    assert crowding([["a", "c"], ["b", "d"]], HOME) == (2, 2)  # each stage on one box, one router
    assert crowding([["a", "b"], ["c", "d"]], HOME) == (0, 2)
    assert crowding([["x", "y"]], {}) == (0, 0)  # nothing known: no conflict claimed
    assert crowded([["a", "c"], ["b", "d"], ["a"]], HOME) == [
        (0, "host", "box1"),
        (1, "host", "box2"),
    ]
    assert crowded([["a", "b"]], HOME) == [(0, "router", "203.0.113.7")]
    assert crowded([["a", "x"]], HOME) == []


def test_place_puts_a_stages_two_replicas_on_distinct_hosts_where_spares_allow() -> None:
    speeds = {p: [5.0, 5.0] for p in "abcd"}
    blind = place(speeds, 2, min_replicas=2)
    assert crowding(_stages(blind, 2), HOME)[0] == 2  # the old placement: each stage on one box
    placed = place(speeds, 2, min_replicas=2, domains=HOME)
    assert crowding(_stages(placed, 2), HOME) == (0, 2)  # one router for all: that stays
    assert bottleneck(placed, speeds, 2) == bottleneck(blind, speeds, 2)


def test_spreading_spares_routers_too_and_gives_up_no_more_than_the_slack() -> None:
    # Two homes: stage 0 on home 1's two machines, stage 1 on home 2's.
    domains = {
        "a": Domains("a", "r1"),
        "b": Domains("b", "r1"),
        "c": Domains("c", "r2"),
        "d": Domains("d", "r2"),
    }
    speeds = {"a": [10.0, 10.0], "b": [10.0, 10.0], "c": [10.0, 10.0], "d": [10.2, 10.2]}
    start = {"a": 0, "b": 0, "c": 1, "d": 1}
    spread_out = spread(start, speeds, 2, domains, min_replicas=2)
    assert crowding(_stages(spread_out, 2), domains) == (0, 0)
    # A swap that would cost more than the slack is not made: c is far slower on stage 0.
    slow = {**speeds, "c": [1.0, 10.0], "d": [1.0, 10.2]}
    assert spread(start, slow, 2, domains, min_replicas=2) == start


def test_spread_keeps_the_bottleneck_within_the_slack_and_min_replicas_on_random_swarms() -> None:
    rng = random.Random(7)
    for _ in range(200):
        stages = rng.randint(2, 4)
        peers = [f"p{i}" for i in range(rng.randint(stages, 10))]
        speeds = {p: [rng.uniform(1.0, 10.0) for _ in range(stages)] for p in peers}
        domains = {p: Domains(f"h{rng.randint(0, 2)}", f"r{rng.randint(0, 1)}") for p in peers}
        floor = rng.randint(1, 2)
        blind = place(speeds, stages, min_replicas=floor)
        placed = place(speeds, stages, min_replicas=floor, domains=domains)
        assert sorted(placed) == sorted(blind)
        before = bottleneck(blind, speeds, stages)
        assert bottleneck(placed, speeds, stages) >= before * (1.0 - SPREAD_SLACK) - 1e-9
        assert crowding(_stages(placed, stages), domains) <= crowding(
            _stages(blind, stages), domains
        )
        sizes = [len(m) for m in _stages(blind, stages)]
        assert min(len(m) for m in _stages(placed, stages)) >= min(min(sizes), floor)


def test_a_joining_peer_fills_min_replicas_in_a_new_domain() -> None:
    # Stage 0 has a (box1), stage 1 has b (box2); c (box1) joins: old code sent it to stage 0.
    speeds = {"c": [5.0, 5.0]}
    old = place_new(speeds, 2, [5.0, 5.0], min_replicas=2, sizes=[1, 1])
    assert old == {"c": 0}
    new = place_new(
        speeds, 2, [5.0, 5.0], min_replicas=2, sizes=[1, 1], domains=HOME, members=[["a"], ["b"]]
    )
    assert new == {"c": 1}
    # Not at any price: where the other stage is far ahead, the bottleneck still decides.
    far = place_new(speeds, 2, [5.0, 50.0], domains=HOME, members=[["a"], ["b"]])
    assert far == {"c": 0}


def test_a_peer_filling_min_replicas_joins_the_stage_where_it_is_new_whatever_the_totals() -> None:
    """CI (test_failure_domains_nat): two homes, a two-stage job with `min_replicas = 2`. Two
    peers of different homes were placed first, one a stage, their stages measured 1612.5 and
    1759.4 samples/s; the two others joined a moment later. Each went to the slower stage
    (more than 5% below the other), whatever its home, so each stage had both replicas of
    one home. Every stage below `min_replicas` takes a peer anyway: among them, the one where
    its host, then its router, is new."""
    homes = {
        "a": Domains("m-a", "10.87.0.2"),
        "c": Domains("m-c", "10.87.0.2"),
        "b": Domains("m-b", "10.87.0.3"),
        "d": Domains("m-d", "10.87.0.3"),
    }
    speeds = {"b": [1612.5, 1759.4]}
    members = [["d"], ["a"]]
    joined = place_new(
        speeds, 2, [1612.5, 1759.4], min_replicas=2, sizes=[1, 1], domains=homes, members=members
    )
    assert joined == {"b": 1}  # beside a, of the other home (was stage 0, beside d)
    both = place_new(
        {"b": [1612.5, 1759.4], "c": [1612.5, 1759.4]},
        2,
        [1612.5, 1759.4],
        min_replicas=2,
        sizes=[1, 1],
        domains=homes,
        members=members,
    )
    assert both == {"b": 1, "c": 0}
    # Once every stage has its floor, the bottleneck decides again (within SPREAD_SLACK).
    more = place_new(
        speeds,
        2,
        [1612.5, 1759.4],
        min_replicas=1,
        sizes=[1, 1],
        domains=homes,
        members=members,
    )
    assert more == {"b": 0}


def test_rebalancing_and_refill_break_ties_towards_distinct_domains() -> None:
    assert move_crowding("c", ["a", "c"], ["b"], HOME) == (-1, 0)  # leaves box1's pair
    assert move_crowding("c", ["c"], ["a"], HOME) == (1, 1)  # joins box1 and its router
    assert move_crowding("c", ["a", "c"], ["b"], None) == (0, 0)
    # Stage 2 lost its replica; stage 0 has a, b (two machines), stage 1 c, d (one machine).
    domains = {
        p: Domains(h, f"r-{h}") for p, h in zip("abcd", ("h1", "h2", "h3", "h3"), strict=True)
    }
    assignment = {"a": 0, "b": 0, "c": 1, "d": 1}
    speeds = {p: [5.0, 5.0, 5.0] for p in assignment}
    assert [m.peer for m in plan_refill(assignment, speeds, 3)] == ["a"]  # by id
    aware = plan_refill(assignment, speeds, 3, domains=domains)
    assert [m.peer for m in aware] == ["c"]  # leaves h3's pair: no stage on one machine
    # A move of equal gain: the one that leaves a crowded host goes (q or r share one).
    assignment = {"p": 0, "q": 0, "r": 0, "s": 1}
    speeds = {"p": [4.0, 4.0], "q": [4.0, 4.0], "r": [4.0, 4.0], "s": [2.0, 2.0]}
    domains = {p: Domains(h, "r") for p, h in zip("pqrs", ("h1", "h2", "h2", "h3"), strict=True)}
    config = RebalanceConfig(min_dwell_s=0.0, move_cost_s=0.0)
    blind = plan_move(assignment, speeds, 2, now=0.0, last_moved={}, config=config)
    assert blind is not None and blind.peer == "p"  # by id
    move = plan_move(assignment, speeds, 2, now=0.0, last_moved={}, config=config, domains=domains)
    assert move is not None and move.peer == "q"
