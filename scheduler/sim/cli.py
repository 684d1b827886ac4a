"""`swarm simulate`: run the discrete-event simulator and print throughput against the optimum.

Exit codes: 0 done, 2 bad input (a setting out of range, `--plot` without matplotlib).
`swarm.cli` loads this module when the command runs: `add_arguments` declares its flags, `run`
runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarm.errors import ConfigError
from swarm.job.config import RebalanceConfig

__all__ = ["add_arguments", "cmd_simulate", "run"]

Command = Callable[[argparse.Namespace], int]
CommandFactory = Callable[[str, Command, str], argparse.ArgumentParser]


def add_arguments(command: str, p: argparse.ArgumentParser) -> None:
    _add_flags(p)


def run(command: str, args: argparse.Namespace) -> int:
    return cmd_simulate(args)


def _add_flags(p: argparse.ArgumentParser) -> None:
    # No flag here reads the environment, unlike the roles' (`swarm.flags`): a simulation's
    # inputs are its command line, and a deployment's SWARM_MIN_REPLICAS (say) is not one.
    p.add_argument("--peers", type=int, default=1000, help="peers at the start")
    p.add_argument("--stages", type=int, default=8, help="pipeline stages")
    p.add_argument("--hours", type=float, default=24.0, help="simulated hours")
    p.add_argument(
        "--churn",
        type=float,
        default=1.0,
        metavar="LIFETIME_HOURS",
        help="mean peer lifetime in hours, exponential; a departure is a crash (0: no churn)",
    )
    p.add_argument(
        "--join-rate",
        type=float,
        default=None,
        help="peer joins per hour, Poisson (default: peers / churn, a pool of about constant size)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument(
        "--policy",
        choices=["none", "swarm"],
        default="swarm",
        help="swarm: rebalance every period; none: never",
    )
    p.add_argument(
        "--hysteresis",
        type=float,
        default=RebalanceConfig().hysteresis,
        help="a move must raise the bottleneck by more than this factor, or the bottleneck be this "
        "factor below the mean stage total (>= 1)",
    )
    p.add_argument(
        "--min-replicas",
        type=int,
        default=1,
        help="replicas every stage gets before any gets more, and keeps (a job's "
        "runtime.min_replicas)",
    )
    p.add_argument(
        "--skew",
        type=float,
        default=0.0,
        help="share of stage 0's initial peers placed elsewhere instead",
    )
    p.add_argument("--window", type=float, default=1.0, help="reporting window, hours")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of a table")
    p.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="also draw throughput and optimum over time (needs matplotlib)",
    )


def cmd_simulate(args: argparse.Namespace) -> int:
    from scheduler.sim.engine import simulate
    from scheduler.sim.model import SimConfig

    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        print(
            "swarm simulate: error: --plot needs matplotlib: pip install matplotlib",
            file=sys.stderr,
        )
        return 2
    try:
        config = SimConfig(
            peers=args.peers,
            stages=args.stages,
            hours=args.hours,
            seed=args.seed,
            policy=args.policy,
            lifetime_h=args.churn,
            join_rate_h=args.join_rate,
            skew=args.skew,
            min_replicas=args.min_replicas,
            window_s=args.window * 3600.0,
        )
        rebalance = dataclasses.replace(config.rebalance_config, hysteresis=args.hysteresis)
        config = dataclasses.replace(config, rebalance=rebalance)
    except ConfigError as e:
        print(f"swarm simulate: error: {e}", file=sys.stderr)
        return 2
    summary = simulate(config)
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2))
    else:
        print(
            f"{'hour':>6} {'samples/s':>10} {'optimum':>10} {'current':>10} {'ratio':>6} "
            f"{'peers':>6} {'joins':>6} {'left':>6} {'moves':>6}"
        )
        for w in summary.windows:
            print(
                f"{w.end_s / 3600:6.1f} {w.samples_per_s:10.1f} {w.optimum:10.1f} "
                f"{w.current:10.1f} {w.ratio:6.3f} {w.peers:6d} {w.joins:6d} "
                f"{w.departures:6d} {w.moves:6d}"
            )
        print(
            f"mean throughput / optimum {summary.mean_ratio:.4f} (policy {summary.policy}; "
            f"/ current placement {summary.mean_ratio_current:.4f}); {summary.moves} moves, "
            f"{summary.joins} joins, {summary.departures} departures; "
            f"{summary.wall_s:.1f} s wall"
        )
    if args.plot is not None:
        _plot(summary.to_dict(), args.plot)
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows = summary["windows"]
    hours = [w["end_s"] / 3600.0 for w in windows]
    fig, ax = plt.subplots(figsize=(8, 4))
    for key, label in (
        ("samples_per_s", "throughput"),
        ("optimum", "optimum (place)"),
        ("current", "current placement"),
    ):
        ax.plot(hours, [w[key] for w in windows], label=label)
    ax.set_xlabel("hours")
    ax.set_ylabel("samples/s")
    ax.set_title(f"policy {summary['policy']}: mean ratio {summary['mean_ratio']:.3f}")
    ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
