"""Rebalancing at scale: throughput / optimum with rebalancing off and on, in the same run, on the
simulator (1,000 heterogeneous peers, 8 stages, mean lifetime one hour, joins keeping the pool about
constant, 24 simulated hours; then 3 hours without churn from a start with stage 0 30% short, where
only the policy can restore the balance), and the per-call cost of the policies on the data and
control path.

    .venv/bin/python bench/rebalance.py [--peers N] [--hours H] [--seed K] [--skew S]

Both runs see the same peers come and go (the simulator draws churn from its own stream), so the
difference between them is the policy's. "Optimum" is `place`'s bottleneck for the peers present
(see scheduler/sim/report.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler.sim import SimClock, SimConfig, Summary, simulate  # noqa: E402
from scheduler.sim.model import class_affinity, new_peer  # noqa: E402
from swarm.job.config import RebalanceConfig  # noqa: E402
from swarm.policy.placement import place  # noqa: E402
from swarm.policy.rebalance import plan_move  # noqa: E402
from swarm.policy.wiring import StagePool  # noqa: E402


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def wiring_cost(replicas: int) -> tuple[float, float]:
    """µs per `choose` alone, and per choose + started + finished (one hop's wiring work)."""
    rng = random.Random(0)
    pool = StagePool(clock=SimClock(), rng=rng, task_samples=1.0)
    for i in range(replicas):
        pool.add(f"peer-{i:05d}", rng.choice([1.0, 2.5, 6.0]))
    for i in range(replicas):  # each measured, with a few tasks queued: a busy pool
        peer = f"peer-{i:05d}"
        pool.started(peer, 1.0)
        pool.finished(peer, 1.0, rng.uniform(0.1, 1.0))
        pool.started(peer, float(rng.randint(0, 3)))

    def hop() -> None:
        peer = pool.choose(1.0)
        pool.started(peer, 1.0)
        pool.finished(peer, 1.0, 0.5)

    return per_call_us(lambda: pool.choose(1.0), 20_000), per_call_us(hop, 20_000)


def plan_cost(peers: int, stages: int) -> tuple[float, float, float, int]:
    """µs per `plan_move` decision on `peers` placed by `place`: with the default config (no move
    passes the hysteresis), with a third of stage 0's peers moved away and hysteresis 1 (a move is
    found), and at the fixed point those moves reach (every candidate examined, none passes);
    and how many moves reached it."""
    config = SimConfig(peers=peers, stages=stages)
    rng, affinity = random.Random(1), class_affinity(config)
    speeds = {}
    for i in range(peers):
        peer, _ = new_peer(rng, f"peer-{i:05d}", config, affinity)
        speeds[peer.name] = peer.speeds
    balanced = place(speeds, stages)
    skewed = dict(balanced)
    first = sorted(p for p, k in balanced.items() if k == 0)
    for i, name in enumerate(first[: len(first) // 3]):
        skewed[name] = 1 + i % (stages - 1)
    eager = RebalanceConfig(hysteresis=1.0, min_dwell_s=0.0)

    def decide(assignment: dict[str, int], rc: RebalanceConfig | None = None) -> object:
        return plan_move(assignment, speeds, stages, now=0.0, last_moved={}, config=rc)

    default = per_call_us(lambda: decide(balanced), 200)
    found = per_call_us(lambda: decide(skewed, eager), 200)
    moves = 0
    while move := plan_move(skewed, speeds, stages, now=0.0, last_moved={}, config=eager):
        skewed[move.peer] = move.dst
        moves += 1
    fixed = per_call_us(lambda: decide(skewed, eager), 200)
    return default, found, fixed, moves


def report(policy: str, s: Summary) -> None:
    worst = min(w.ratio for w in s.windows)
    seconds = sum(w.end_s - w.start_s for w in s.windows)
    done = sum(w.completed_per_s * (w.end_s - w.start_s) for w in s.windows)
    print(
        f"  rebalancing {'on ' if policy == 'swarm' else 'off'}: throughput/optimum "
        f"{s.mean_ratio:.4f} (worst window {worst:.4f}, last {s.windows[-1].ratio:.4f}; "
        f"/current placement {s.mean_ratio_current:.4f}; finished {done / seconds:.1f} "
        f"samples/s)  moves {s.moves}, joins {s.joins}, departures {s.departures}, "
        f"failed hops {s.failed_hops}, {s.events} events, {s.wall_s:.1f} s"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--churn", type=float, default=1.0, help="mean lifetime, hours")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--skew", type=float, default=0.3, help="share of stage 0's peers placed elsewhere"
    )
    parser.add_argument(
        "--hysteresis",
        type=float,
        default=RebalanceConfig().hysteresis,
        help="the rebalancing run's hysteresis (default: the policy's)",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    print(
        f"{args.peers} peers, {args.stages} stages, mean lifetime {args.churn:g} h (joins "
        f"{args.peers / args.churn:g}/h), seed {args.seed}, hysteresis {args.hysteresis:g}"
    )
    scenarios = [  # (name, hours, mean lifetime in hours (0: no churn), stage 0's shortfall)
        ("under churn", args.hours, args.churn, 0.0),
        # Without churn nothing but the policy rebalances the swarm.
        (f"no churn, stage 0 started {args.skew:.0%} short", 3.0, 0.0, args.skew),
    ]
    for name, hours, lifetime_h, skew in scenarios:
        print(f" {name}, {hours:g} h:")
        for policy in ("none", "swarm"):
            config = SimConfig(
                peers=args.peers,
                stages=args.stages,
                hours=hours,
                lifetime_h=lifetime_h,
                skew=skew,
                seed=args.seed,
                policy=policy,
            )
            rebalance = dataclasses.replace(config.rebalance_config, hysteresis=args.hysteresis)
            report(policy, simulate(dataclasses.replace(config, rebalance=rebalance)))
    choose, hop = wiring_cost(1000)
    print(
        f"  wiring, 1,000 replicas: StagePool.choose {choose:.2f} µs/call; "
        f"choose+started+finished {hop:.2f} µs/hop"
    )
    default, found, fixed, moves = plan_cost(args.peers, args.stages)
    print(
        f"  plan_move, {args.peers} peers x {args.stages} stages: {default:.0f} µs/call "
        f"(placed by `place`, default config: no move), {found:.0f} µs/call (a third of "
        f"stage 0 moved away, hysteresis 1: a move), {fixed:.0f} µs/call (the fixed point "
        f"{moves} such moves reach: every candidate examined)"
    )
    print(f"  wall {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
