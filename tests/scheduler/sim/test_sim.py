"""The simulator: reproducible, fast on small runs, bounded by its optimum, plausible churn, and
rebalancing paying off where a stage starts under-served; and `swarm simulate`'s command line."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any

import pytest

from scheduler.sim import SimConfig, Summary, simulate
from scheduler.sim.cli import cmd_simulate
from scheduler.sim.model import hop_stage, hop_work
from scheduler.sim.registry import Registry
from swarm.cli import parse
from swarm.errors import ConfigError
from swarm.job.config import RebalanceConfig
from swarm.policy.domains import Domains

SMALL = SimConfig(peers=30, stages=4, hours=1.0, lifetime_h=1.0, window_s=900.0, seed=1)
SLACK = 1e-9


def run(**changes: Any) -> Summary:
    return simulate(dataclasses.replace(SMALL, **changes))


def test_hops_go_forward_then_back_with_the_last_stage_fused() -> None:
    assert [hop_stage(h, 3) for h in range(5)] == [0, 1, 2, 1, 0]
    assert [hop_work(h, 3, 0.25) for h in range(5)] == [0.25, 0.25, 1.0, 0.75, 0.75]
    assert hop_stage(0, 1) == 0 and hop_work(0, 1, 0.25) == 1.0


@pytest.mark.parametrize(
    "field, value",
    [
        ("peers", 0),
        ("stages", 0),
        ("hours", 0.0),
        ("skew", 1.0),
        ("forward_share", 1.0),
        ("stage_costs", (1.0, 2.0)),
        ("lifetime_h", -1.0),
        ("policy", "random"),
        ("min_replicas", 0),
    ],
)
def test_config_rejects_bad_values(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        SimConfig(**{field: value})


def test_a_seed_reproduces_the_summary_and_another_does_not() -> None:
    first, again = run(), run()
    assert first == again  # every number, window by window (wall time aside)
    assert first.to_dict() | {"wall_s": 0} == again.to_dict() | {"wall_s": 0}
    assert run(seed=2) != first


def test_small_runs_are_fast() -> None:
    for changes in ({}, {"policy": "none"}, {"trainers": 2}, {"peers": 60, "stages": 8}):
        start = time.perf_counter()
        run(**changes)
        assert time.perf_counter() - start < 5.0, changes


def test_throughput_never_exceeds_the_optimum() -> None:
    for summary in (run(), run(skew=0.5, policy="none"), run(lifetime_h=0.3, trainers=2)):
        assert summary.windows
        for w in summary.windows:
            assert 0.0 < w.samples_per_s <= w.current * (1 + SLACK), w
            assert w.current <= w.optimum * (1 + SLACK), w
        assert 0.5 < summary.mean_ratio <= 1 + SLACK
        assert summary.mean_ratio <= summary.mean_ratio_current + SLACK


def test_without_churn_the_pipeline_runs_near_its_optimum() -> None:
    summary = run(lifetime_h=0.0, hours=2.0)
    assert (summary.joins, summary.departures, summary.failed_hops) == (0, 0, 0)
    assert summary.windows[-1].peers == SMALL.peers
    assert summary.mean_ratio > 0.95


def test_joins_and_departures_are_plausible() -> None:
    # 30 peers living an hour on average, 30 joins an hour, two hours: about 60 of each.
    summary = run(hours=2.0)
    sd = math.sqrt(60)
    assert abs(summary.joins - 60) < 4 * sd
    assert abs(summary.departures - 60) < 4 * sd
    assert summary.windows[-1].peers == SMALL.peers + summary.joins - summary.departures
    assert sum(w.joins for w in summary.windows) == summary.joins
    assert summary.failed_hops > 0  # crashes hit replicas at work
    assert run(join_rate_h=0.0, hours=2.0).joins == 0


def test_rebalancing_beats_none_where_a_stage_starts_under_served() -> None:
    scenario = {"peers": 24, "lifetime_h": 0.0, "skew": 0.6, "hours": 2.0}
    none, swarm = run(policy="none", **scenario), run(policy="swarm", **scenario)
    assert none.moves == 0 and swarm.moves > 0
    assert swarm.mean_ratio > none.mean_ratio + 0.15
    assert swarm.windows[-1].ratio > 0.95
    assert none.windows[-1].ratio < 0.8


def test_policy_none_never_moves_under_churn() -> None:
    assert run(policy="none", lifetime_h=0.5).moves == 0


# -- the command line ------------------------------------------------------------------------


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    args = parse(["simulate", *argv])
    code = cmd_simulate(args)
    out, err = capsys.readouterr()
    return code, out, err


SMALL_ARGS = ("--peers", "20", "--stages", "3", "--hours", "0.5", "--window", "0.25")


def test_cli_prints_a_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, *SMALL_ARGS, "--seed", "3")
    assert code == 0 and "mean throughput / optimum" in out and len(out.splitlines()) == 4
    code, out, _ = cli(capsys, *SMALL_ARGS, "--seed", "3", "--json", "--policy", "none")
    summary = json.loads(out)
    assert code == 0 and summary["policy"] == "none" and len(summary["windows"]) == 2
    for key in ("mean_ratio", "moves", "joins", "departures", "wall_s"):
        assert key in summary


def test_cli_rejects_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "--peers", "0")
    assert code == 2 and "peers" in err
    code, _, err = cli(capsys, *SMALL_ARGS, "--hysteresis", "0.5")
    assert code == 2 and "hysteresis" in err


def test_cli_plot_writes_a_png(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    code, out, _ = cli(capsys, *SMALL_ARGS, "--plot", str(tmp_path / "t.png"))
    assert code == 0 and "wrote" in out
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_simulated_scheduler_keeps_min_replicas_and_refills_an_emptied_stage() -> None:
    """The simulator's registry makes the scheduler's calls with the job's min_replicas:
    placement gives every stage two, a joining peer goes to a stage short of two, rebalancing
    keeps two, and a stage that loses its last replica gets a spare at once."""
    registry = Registry(3, RebalanceConfig(hysteresis=1.0, min_dwell_s=0.0, move_cost_s=0.0), 2)
    speeds = {f"p{i}": [1.0 + i, 1.0 + i, 1.0 + i] for i in range(6)}
    for peer, row in speeds.items():
        registry.add(peer, row)
    for peer, stage in registry.place_all().items():
        registry.assign(peer, stage)

    def sizes() -> list[int]:
        return [list(registry.assignment.values()).count(k) for k in range(3)]

    assert sizes() == [2, 2, 2]
    assert registry.plan(0.0) is None  # a faster bottleneck would take a stage below two
    lost = [p for p, k in registry.assignment.items() if k == 0]
    registry.remove(lost[0])
    registry.add("new", [9.0, 9.0, 9.0])
    stage = registry.join_stage("new")
    assert stage == 0  # the stage short of two
    registry.assign("new", stage)
    for peer in [p for p, k in registry.assignment.items() if k == 1]:
        registry.remove(peer)  # stage 1 loses both
    moves = registry.refill(1.0)
    assert len(moves) == 1 and moves[0].dst == 1 and sizes()[1] == 1


def test_peers_on_shared_machines_and_routers_run_near_the_optimum_spread_over_them() -> None:
    """Peers on 8 machines behind 4 routers (`hosts`), two replicas a stage: the simulated
    scheduler spreads each stage's replicas over machines (placement, joins, rebalancing all
    given the domains), and the pipeline still runs near its optimum (which ignores them)."""
    summary = run(lifetime_h=0.0, hours=2.0, min_replicas=2, hosts=8)
    assert summary.mean_ratio > 0.95
    registry = Registry(2, RebalanceConfig(), 2)
    for i, peer in enumerate("abcd"):
        registry.add(peer, [5.0, 5.0], Domains(f"host-{i % 2}", "router-0"))
    placed = registry.place_all()
    # a, c on host-0 and b, d on host-1: each stage gets one of each (blind: a, c on one)
    assert placed["a"] != placed["c"] and placed["b"] != placed["d"], placed


def test_the_simulator_reads_no_deployments_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its flags defaulted from `SWARM_<FLAG>` without its `--help` saying so: a scheduler's
    SWARM_MIN_REPLICAS changed what `swarm simulate` simulated (a review found it)."""
    from swarm.cli import parse

    monkeypatch.setenv("SWARM_MIN_REPLICAS", "3")
    monkeypatch.setenv("SWARM_PEERS", "7")
    args = parse(["simulate"])
    assert (args.min_replicas, args.peers) == (1, 1000)
