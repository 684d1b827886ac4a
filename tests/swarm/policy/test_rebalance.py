"""Rebalancing policy: safety (never empty a stage, dwell, no flip-flop), hysteresis, the cost
check, the choice of move against brute force, determinism, and its cost at 1,000 peers."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest

from swarm.errors import ConfigError
from swarm.job.config import RebalanceConfig
from swarm.policy.placement import bottleneck, place, stage_totals
from swarm.policy.rebalance import Move, Rebalancer, plan_move, plan_refill

# Every check but the one under test switched off.
EAGER = RebalanceConfig(hysteresis=1.0, min_dwell_s=0.0, move_cost_s=0.0)


def uniform(**peers: float) -> dict[str, list[float]]:
    """Peers as fast on every stage (two stages), by name."""
    return {name: [speed, speed] for name, speed in peers.items()}


def decide(
    assignment: Mapping[str, int],
    speeds: Mapping[str, Sequence[float]],
    stages: int = 2,
    config: RebalanceConfig = EAGER,
    now: float = 0.0,
    last_moved: Mapping[str, float] | None = None,
) -> Move | None:
    return plan_move(
        assignment, speeds, stages, now=now, last_moved=last_moved or {}, config=config
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("period_s", 0.0),
        ("hysteresis", 0.99),
        ("min_dwell_s", -1.0),
        ("move_cost_s", -1.0),
        ("horizon_s", 60.0),
        ("hysteresis", float("nan")),
        ("period_s", float("inf")),
        ("min_dwell_s", float("inf")),
    ],
)
def test_config_rejects_bad_values(field: str, value: float) -> None:
    kwargs: dict[str, Any] = {field: value}  # the job file's section has a bool field too
    with pytest.raises(ConfigError, match=field):
        RebalanceConfig(**kwargs)


def test_moves_a_peer_into_the_bottleneck_and_reports_the_gain() -> None:
    speeds = uniform(x=10.0, a=8.0, b=4.0, c=12.0)  # stage 0: 10, stage 1: 24
    move = decide({"x": 0, "a": 1, "b": 1, "c": 1}, speeds)
    # a -> 16 on stage 1 and 18 on stage 0; b leaves 14 on stage 0, c 12: a lifts it most.
    assert move == Move(peer="a", src=1, dst=0, before=10.0, after=16.0)


def test_never_empties_a_stage() -> None:
    # Stage 1 is the most over-served but has one peer; stage 2 can give.
    speeds = {
        "x": [1.0, 1.0, 1.0],
        "big": [9.0, 9.0, 9.0],
        "y": [2.0, 2.0, 2.0],
        "z": [2.0, 2.0, 2.0],
    }
    move = decide({"x": 0, "big": 1, "y": 2, "z": 2}, speeds, stages=3)
    assert move is not None and move.peer != "big" and move.src == 2
    assert decide({"x": 0, "big": 1}, uniform(x=1.0, big=9.0)) is None


def test_falls_back_to_a_less_over_served_stage_when_the_most_cannot_help() -> None:
    # Stage 1 (the most over-served) only has peers that cannot serve stage 0 at all.
    speeds = {
        "x": [1.0, 1.0, 1.0],
        "p": [0.0, 5.0, 5.0],
        "q": [0.0, 5.0, 5.0],
        "r": [2.0, 2.0, 2.0],
        "s": [2.0, 2.0, 2.0],
    }
    move = decide({"x": 0, "p": 1, "q": 1, "r": 2, "s": 2}, speeds, stages=3)
    assert move is not None and move.src == 2 and move.dst == 0


@pytest.mark.parametrize("hysteresis, moves", [(1.49, True), (1.5, False), (1.6, False)])
def test_hysteresis_holds(hysteresis: float, moves: bool) -> None:
    speeds = uniform(x=10.0, a=5.0, b=15.0)  # moving a: 10 -> 15, a factor of exactly 1.5
    config = RebalanceConfig(hysteresis=hysteresis, min_dwell_s=0.0, move_cost_s=0.0)
    move = decide({"x": 0, "a": 1, "b": 1}, speeds, config=config)
    assert (move is not None) is moves
    if move is not None:
        assert move.after > move.before * hysteresis


def crowd(counts: Sequence[int], speed: float = 1.0) -> tuple[dict[str, int], dict]:
    """`counts[k]` equal peers on stage k (as fast on every stage)."""
    assignment = {f"s{k}p{i:03d}": k for k, n in enumerate(counts) for i in range(n)}
    return assignment, {p: [speed] * len(counts) for p in assignment}


def test_a_large_swarm_out_of_balance_moves_on_small_gains() -> None:
    # 400 peers: one move lifts stage 0 from 70 to 71 (1.4%), below the hysteresis, but the stage
    # sits 30% under the mean of 100: the imbalance, not the single move, is what the factor tests.
    config = RebalanceConfig(hysteresis=1.1, min_dwell_s=0.0, move_cost_s=60.0)
    assignment, speeds = crowd([70, 110, 110, 110])
    move = decide(assignment, speeds, 4, config=config)
    assert move is not None and (move.dst, move.before, move.after) == (0, 70.0, 71.0)
    # Within the factor of the mean (95 * 1.1 > 100), a 1% move is not worth it.
    assignment, speeds = crowd([95, 102, 102, 101])
    assert decide(assignment, speeds, 4, config=config) is None


@pytest.mark.parametrize("hysteresis", [1.02, 1.05, 1.1])
def test_out_of_balance_moves_stop_within_the_factor_of_the_mean(hysteresis: float) -> None:
    config = RebalanceConfig(hysteresis=hysteresis, min_dwell_s=0.0, move_cost_s=60.0)
    assignment, speeds = crowd([70, 110, 110, 110])
    lifted = [70.0]
    for now in range(200):
        move = decide(assignment, speeds, 4, config=config, now=float(now))
        if move is None:
            break
        assert move.before == lifted[-1] and move.after > move.before
        assignment[move.peer] = move.dst
        lifted.append(bottleneck(assignment, speeds, 4))
        assert lifted[-1] == move.after
    else:
        pytest.fail("no fixed point within 200 decisions")
    assert lifted[-1] * hysteresis >= 100.0  # within the factor of the mean (400 / 4)
    # Every move was made while out of balance, so it stopped there: no moves for nothing.
    assert all(b * hysteresis < 100.0 for b in lifted[:-1])
    assert len(lifted) - 1 <= 30  # one move per peer short of the mean, at most


def test_no_move_when_two_stages_share_the_bottleneck() -> None:
    speeds = {"x": [4.0] * 3, "y": [4.0] * 3, "a": [3.0] * 3, "b": [3.0] * 3}
    assert decide({"x": 0, "y": 1, "a": 2, "b": 2}, speeds, stages=3) is None


def test_out_of_balance_lifts_tied_bottleneck_stages_one_by_one() -> None:
    # Stages 0 and 1 tie at 10 under a mean of 20: no single move lifts the bottleneck, two do.
    config = RebalanceConfig(hysteresis=1.05, min_dwell_s=0.0, move_cost_s=60.0)
    speeds = {name: [10.0] * 3 for name in ["x", "y", "a", "b", "c", "d"]}
    assignment = {"x": 0, "y": 1, "a": 2, "b": 2, "c": 2, "d": 2}
    first = decide(assignment, speeds, 3, config=config)
    assert first == Move("a", 2, 0, before=10.0, after=10.0)  # the tie is gone, not yet the floor
    assignment["a"] = 0
    second = decide(assignment, speeds, 3, config=config, now=1.0)
    assert second == Move("b", 2, 1, before=10.0, after=20.0)
    assignment["b"] = 1
    assert decide(assignment, speeds, 3, config=config, now=2.0) is None  # 20, 20, 20


def test_dwell_blocks_the_moved_peer_and_the_stage_it_joined() -> None:
    speeds = {
        name: [speed] * 3
        for name, speed in {"x": 10.0, "a": 8.0, "b": 12.0, "c": 8.0, "d": 13.0}.items()
    }
    assignment = {"x": 0, "a": 1, "b": 1, "c": 2, "d": 2}  # totals 10, 20, 21
    config = RebalanceConfig(hysteresis=1.0, min_dwell_s=300.0, move_cost_s=0.0)

    def at(now: float, last_moved: dict[str, float]) -> Move | None:
        return decide(assignment, speeds, 3, config=config, now=now, last_moved=last_moved)

    assert at(1000.0, {}) == Move("c", 2, 0, 10.0, 13.0)  # from the most over-served stage
    # d joined stage 2 100 s ago: stage 2 gives nobody away (nor may d move): stage 1 gives.
    assert at(1000.0, {"d": 900.0}) == Move("a", 1, 0, 10.0, 12.0)
    assert at(1000.0, {"c": 900.0}) == Move("a", 1, 0, 10.0, 12.0)
    assert at(1200.0, {"d": 900.0}) == Move("c", 2, 0, 10.0, 13.0)  # the dwell is over
    assert at(1000.0, {"c": 900.0, "a": 900.0}) is None


@pytest.mark.parametrize("cost_s, moves", [(599.0, True), (601.0, False)])
def test_cost_check_weighs_the_download(cost_s: float, moves: bool) -> None:
    # Moving a (rate 5 at its source) lifts the bottleneck by 5: it pays if
    # 5 * (horizon - cost) > 5 * cost, i.e. cost < horizon / 2 = 600 s.
    speeds = uniform(x=10.0, a=5.0, b=15.0)
    config = RebalanceConfig(hysteresis=1.0, min_dwell_s=0.0, move_cost_s=cost_s, horizon_s=1200.0)
    assert (decide({"x": 0, "a": 1, "b": 1}, speeds, config=config) is not None) is moves


def test_cost_check_prefers_a_cheaper_peer_when_the_best_does_not_pay() -> None:
    # a lifts the bottleneck most (10 -> 16) but gives up 20 at its source: 6 * 300 <= 20 * 100.
    # b lifts it less (10 -> 14) and gives up 4: 4 * 300 > 4 * 100. c cannot serve stage 0.
    speeds = {"x": [10.0, 10.0], "a": [6.0, 20.0], "b": [4.0, 4.0], "c": [0.0, 30.0]}
    assignment = {"x": 0, "a": 1, "b": 1, "c": 1}
    config = RebalanceConfig(hysteresis=1.0, min_dwell_s=0.0, move_cost_s=100.0, horizon_s=400.0)
    assert decide(assignment, speeds, config=config) == Move("b", 1, 0, 10.0, 14.0)
    assert decide(assignment, speeds) == Move("a", 1, 0, 10.0, 16.0)


def test_ties_are_deterministic() -> None:
    speeds = {"x": [1.0] * 3, "p2": [2.0] * 3, "p1": [2.0] * 3, "q1": [2.0] * 3, "q2": [2.0] * 3}
    assignment = {"x": 0, "p2": 1, "p1": 1, "q1": 2, "q2": 2}
    move = decide(assignment, speeds, stages=3)
    # Stages 1 and 2 tie as most over-served: the lower index; then p1 and p2 tie: the lower id.
    assert move is not None and (move.peer, move.src) == ("p1", 1)
    reordered = dict(reversed(list(assignment.items())))
    assert decide(reordered, speeds, stages=3) == move


def random_instance(rng: random.Random, peers: int, stages: int) -> tuple[dict, dict]:
    speeds = {f"p{i:02d}": [rng.uniform(0.5, 6.0) for _ in range(stages)] for i in range(peers)}
    assignment = {p: rng.randrange(stages) for p in speeds}
    return assignment, speeds


def test_picks_the_best_single_move_from_the_first_stage_that_can_help() -> None:
    rng = random.Random(7)
    checked = tied = 0
    for _ in range(300):
        stages = rng.randint(2, 4)
        assignment, speeds = random_instance(rng, rng.randint(stages, 10), stages)
        totals = stage_totals(assignment, speeds, stages)
        before = min(totals)
        move = decide(assignment, speeds, stages)
        dst = totals.index(before)
        sources = sorted((k for k in range(stages) if k != dst), key=lambda k: (-totals[k], k))
        out_of_balance = before < sum(totals) / stages  # EAGER: hysteresis 1
        expected = None
        for src in sources:  # brute force: every peer of src, in order of over-service
            peers = [p for p, k in assignment.items() if k == src]
            if len(peers) < 2:
                continue
            found = []  # (new bottleneck, new minimum of src and dst) of each valid move
            for p in peers:
                new = stage_totals({**assignment, p: dst}, speeds, stages)
                after, lifted = min(new), min(new[src], new[dst])
                if lifted > before * (1 + 1e-9) and (out_of_balance or after > before):
                    found.append((after, lifted))
            if found:
                expected = (src, *max(found))
                break
        if expected is None:
            assert move is None
            continue
        checked += 1
        tied += expected[1] == before  # a stage tied with dst: the bottleneck waits a move
        assert move is not None and (move.src, move.dst) == (expected[0], dst)
        assert move.after == pytest.approx(expected[1], rel=1e-12)
        new = stage_totals({**assignment, move.peer: dst}, speeds, stages)
        assert min(new) == pytest.approx(move.after, rel=1e-12)
        assert min(new[move.src], new[dst]) == pytest.approx(expected[2], rel=1e-12)
    assert checked > 100 and tied > 5


def test_no_oscillation_under_changing_speeds() -> None:
    """Decisions every period while every peer's speeds drift: no peer moves again within
    min_dwell_s (so never back to the stage it left), and no stage gives a peer away within
    min_dwell_s of receiving one."""
    rng = random.Random(3)
    config = RebalanceConfig(hysteresis=1.02, min_dwell_s=300.0, move_cost_s=0.0)
    assignment, speeds = random_instance(rng, 24, 4)
    last_moved: dict[str, float] = {}
    received: dict[int, float] = {}
    moves = 0
    for step in range(600):
        now = step * config.period_s
        for row in speeds.values():
            for k in range(len(row)):
                row[k] *= rng.lognormvariate(0.0, 0.05)
        move = plan_move(assignment, speeds, 4, now=now, last_moved=last_moved, config=config)
        if move is None:
            continue
        moves += 1
        assert now - last_moved.get(move.peer, -1e9) >= config.min_dwell_s
        assert now - received.get(move.src, -1e9) >= config.min_dwell_s
        assert sum(1 for k in assignment.values() if k == move.src) >= 2
        assignment[move.peer] = move.dst
        last_moved[move.peer] = now
        received[move.dst] = now
    assert moves > 10  # the drift does call for moves


def test_stable_speeds_reach_a_fixed_point() -> None:
    rng = random.Random(11)
    config = RebalanceConfig(hysteresis=1.0, min_dwell_s=300.0, move_cost_s=30.0)
    for _ in range(20):
        assignment, speeds = random_instance(rng, 30, 5)
        last_moved: dict[str, float] = {}
        now, quiet, bottlenecks = 0.0, 0, []
        while quiet < 20:  # twenty quiet periods in a row: longer than any dwell
            move = plan_move(assignment, speeds, 5, now=now, last_moved=last_moved, config=config)
            if move is None:
                quiet += 1
            else:
                quiet = 0
                assignment[move.peer] = move.dst
                last_moved[move.peer] = now
                bottlenecks.append(bottleneck(assignment, speeds, 5))
            now += config.period_s
            assert now < 1e6, "no fixed point"
        assert bottlenecks == sorted(bottlenecks)  # every move lifted the bottleneck
        later = plan_move(assignment, speeds, 5, now=now + 1e5, last_moved={}, config=config)
        assert later is None


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="out of range"):
        decide({"a": 2}, uniform(a=1.0))
    with pytest.raises(ValueError, match="speeds"):
        decide({"a": 0}, {"a": [1.0]})
    assert decide({"a": 0}, {"a": [1.0]}, stages=1) is None


class CountedSpeeds(Mapping[str, Sequence[float]]):
    """Speeds that count how often a decision reads a peer's row: the work a decision does."""

    def __init__(self, speeds: Mapping[str, Sequence[float]]) -> None:
        self.speeds = speeds
        self.reads = 0

    def __getitem__(self, peer: str) -> Sequence[float]:
        self.reads += 1
        return self.speeds[peer]

    def __iter__(self) -> Iterator[str]:
        return iter(self.speeds)

    def __len__(self) -> int:
        return len(self.speeds)


def test_one_decision_at_1000_peers_is_cheap() -> None:
    """A decision reads each peer's speeds a bounded number of times: linear in the peers, so
    one at 1,000 peers stays cheap (bench/rebalance.py times it; a test asserts no wall time)."""
    reads: dict[int, int] = {}
    for peers in (1000, 2000):
        rng = random.Random(5)
        stages = 8
        speeds = {
            f"p{i:04d}": [rng.choice([1.0, 2.5, 6.0]) * rng.uniform(0.9, 1.1)] * stages
            for i in range(peers)
        }
        assignment = place(speeds, stages, rounds=0, budget=20_000)
        # Hysteresis 1: every stage's candidates are examined (the most expensive decision).
        config = RebalanceConfig(hysteresis=1.0, min_dwell_s=0.0)
        counted = CountedSpeeds(speeds)
        plan_move(assignment, counted, stages, now=0.0, last_moved={}, config=config)
        reads[peers] = counted.reads
    assert reads[1000] <= 2 * 1000, reads  # about two reads a peer, not one per pair
    assert reads[2000] <= 2.2 * reads[1000], reads  # twice the peers, twice the work


def test_the_rebalancer_remembers_moves_for_the_dwell_only() -> None:
    """`Rebalancer` (what the scheduler and the simulator call) decides as `plan_move` with the
    history of its own moves, and forgets a move once the dwell has passed."""
    config = RebalanceConfig(hysteresis=1.0, min_dwell_s=300.0, move_cost_s=0.0)
    rebalancer = Rebalancer(config)
    speeds = uniform(x=10.0, a=8.0, b=4.0, c=12.0)
    assignment = {"x": 0, "a": 1, "b": 1, "c": 1}
    move = rebalancer.decide(assignment, speeds, 2, now=0.0)
    assert move == decide(assignment, speeds, config=config) and move is not None
    assert rebalancer.last_moved == {"a": 0.0}
    assignment[move.peer] = move.dst  # stage 0: 18, stage 1: 16; only the way back would help
    history = dict(rebalancer.last_moved)
    for now in (1.0, 299.0):
        expected = decide(assignment, speeds, config=config, now=now, last_moved=history)
        assert rebalancer.decide(assignment, speeds, 2, now=now) == expected
    assert rebalancer.last_moved == {"a": 0.0}
    rebalancer.decide({"x": 0, "a": 0, "b": 1}, uniform(x=1.0, a=1.0, b=1.0), 2, now=300.0)
    assert rebalancer.last_moved == {}  # past the dwell: forgotten
    rebalancer.last_moved["gone"] = 299.0
    rebalancer.forget("gone")
    assert rebalancer.last_moved == {}


# -- min_replicas and stalls -----------------------------------------------------------------------


def test_never_takes_a_stage_below_min_replicas_to_feed_the_bottleneck() -> None:
    # Stage 0 (one slow replica) is the bottleneck; stage 1 has two fast ones. With the default
    # a fast one moves; with min_replicas = 2 stage 1 keeps both, whatever the gain.
    speeds = uniform(x=1.0, a=10.0, b=10.0)
    assignment = {"x": 0, "a": 1, "b": 1}
    assert decide(assignment, speeds) is not None
    move = plan_move(assignment, speeds, 2, now=0.0, last_moved={}, config=EAGER, min_replicas=2)
    assert move is None
    # A stage above the floor still gives: three on stage 1, min_replicas = 2.
    three = {**assignment, "c": 1}
    speeds3 = uniform(x=1.0, a=10.0, b=10.0, c=10.0)
    move = Rebalancer(EAGER, min_replicas=2).decide(three, speeds3, 2, now=0.0)
    assert move is not None and move.src == 1 and move.dst == 0
    assert Rebalancer(EAGER, min_replicas=3).decide(three, speeds3, 2, now=0.0) is None


def test_rebalancing_never_goes_below_min_replicas_over_many_decisions() -> None:
    rng = random.Random(3)
    for _ in range(100):
        stages, m = rng.randint(2, 4), rng.randint(1, 3)
        speeds = {f"p{i}": [rng.uniform(0.5, 9.0) for _ in range(stages)] for i in range(12)}
        assignment = place(speeds, stages, min_replicas=m)
        rebalancer = Rebalancer(EAGER, min_replicas=m)
        for now in range(20):
            speeds = {p: [s * rng.uniform(0.5, 2.0) for s in row] for p, row in speeds.items()}
            move = rebalancer.decide(assignment, speeds, stages, float(now))
            if move is not None:
                assignment[move.peer] = move.dst
            sizes = [sum(1 for k in assignment.values() if k == s) for s in range(stages)]
            assert min(sizes) >= min(m, 12 // stages), (sizes, m)


def test_a_stage_that_lost_its_last_replica_gets_a_spare_at_once() -> None:
    # Stage 1 is empty; stage 2 has two replicas, stage 0 one. The spare of stage 2 moves,
    # whatever the dwell, hysteresis or cost (nothing trains meanwhile): the faster one at
    # stage 1 ("b"), leaving the higher bottleneck.
    config = RebalanceConfig(min_dwell_s=1e6, move_cost_s=1e3)
    rebalancer = Rebalancer(config)
    speeds = {"x": [5.0, 5.0, 5.0], "a": [4.0, 2.0, 4.0], "b": [4.0, 3.0, 4.0]}
    assignment = {"x": 0, "a": 2, "b": 2}
    rebalancer.last_moved["b"] = 0.0  # moved a moment ago: a stall outweighs the dwell
    assert rebalancer.refill(assignment, speeds, 3, now=1.0) == [
        Move(peer="b", src=2, dst=1, before=0.0, after=3.0)
    ]
    assert rebalancer.last_moved["b"] == 1.0  # remembered: rebalancing leaves it there
    # No spare (every stage has one replica, or the spare cannot serve it): nothing moves, and
    # starting a stage server stays the remedy.
    assert plan_refill({"x": 0, "a": 2}, speeds, 3) == []
    cannot = {**speeds, "a": [4.0, 0.0, 4.0], "c": [4.0, 0.0, 4.0]}
    assert plan_refill({"x": 0, "a": 2, "c": 2}, cannot, 3) == []
    # Two empty stages, two spares: one each.
    four = {p: [2.0] * 4 for p in ("a", "b", "c", "d")}
    moves = plan_refill({"a": 0, "b": 0, "c": 0, "d": 1}, four, 4)
    assert [(m.peer, m.src, m.dst) for m in moves] == [("a", 0, 2), ("b", 0, 3)]


def test_a_stall_takes_a_spare_above_min_replicas_first() -> None:
    # min_replicas = 2: stage 0 has two (its floor), stage 1 three (one above it). Stage 2 is
    # empty: the replica above the floor moves, not one of stage 0's.
    speeds = {p: [3.0, 3.0, 3.0] for p in ("a", "b", "c", "d", "e")}
    speeds["a"] = [9.0, 9.0, 9.0]  # the fastest: it would be taken first, were stage 0 above
    moves = plan_refill({"a": 0, "b": 0, "c": 1, "d": 1, "e": 1}, speeds, 3, min_replicas=2)
    assert [(m.src, m.dst) for m in moves] == [(1, 2)]
    # With no stage above its floor, a stall still takes a second replica (thinner redundancy
    # beats no training), never a stage's last.
    moves = plan_refill({"a": 0, "b": 0, "c": 1}, speeds, 3, min_replicas=2)
    assert [(m.peer, m.src, m.dst) for m in moves] == [("a", 0, 2)]
