"""bench/standby_cost.py's score on canned wan.py reports (issue 67, item 3): on each link the
median of the pairs' with/without ratios of seconds a step against 1.05, at least three pairs,
each stage's standby found by its host's bytes, and the bench's exit status follows the score."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import standby_cost


def report(unshaped_s: float, shaped_s: float, standby: bool = False) -> dict[str, Any]:
    """A wan.py report of 10 timed steps at these seconds a step; with `standby`, two servers a
    stage, the second of each (`s<k>r1`) sending nothing and receiving a stage's sum a step."""

    def hosts(received: float) -> dict[str, dict[str, float]]:
        if not standby:
            return {f"stage{k}": {"sent": 3e5, "received": 3e5} for k in range(4)}
        out = {}
        for k in range(4):
            out[f"s{k}r0"] = {"sent": 3e5 + received, "received": 3e5}
            out[f"s{k}r1"] = {"sent": 2e3, "received": received * (k + 1)}
        return out

    return {
        "workload": {"name": "d256", "microbatches": 8, "stages": 4},
        "unshaped": {"seconds": 10 * unshaped_s, "steps": 10, "bytes_per_microbatch": hosts(1e5)},
        "shaped": {"seconds": 10 * shaped_s, "steps": 10, "bytes_per_microbatch": hosts(1e5)},
    }


def test_each_links_median_ratio_is_the_score() -> None:
    # one loaded pair does not move the medians
    pairs = [
        (report(1.02, 2.08, True), report(1.0, 2.0)),
        (report(2.0, 4.0, True), report(1.0, 2.0)),
        (report(1.01, 2.02, True), report(1.0, 2.0)),
    ]
    scored = standby_cost.score(pairs)
    assert scored.ratios["unshaped"] == pytest.approx([1.02, 2.0, 1.01])
    assert scored.medians == pytest.approx({"unshaped": 1.02, "shaped": 1.04})
    assert scored.passed
    missed = [(report(1.0, 2.2, True), report(1.0, 2.0))] * 3  # shaped 10% slower
    assert not standby_cost.score(missed).passed
    assert standby_cost.score([(report(1.05, 2.1, True), report(1.0, 2.0))] * 3).passed


def test_fewer_than_three_pairs_or_a_bad_time_is_refused() -> None:
    with pytest.raises(ValueError, match="3 or more"):
        standby_cost.score([(report(1.0, 1.0, True), report(1.0, 1.0))] * 2)
    with pytest.raises(ValueError, match="positive"):
        standby_cost.score([(report(1.0, 0.0, True), report(1.0, 1.0))] * 3)


def test_each_stages_standby_is_its_host_that_sent_least() -> None:
    got = standby_cost.standby_bytes(report(1.0, 1.0, True), "shaped")
    assert got == {k: (f"s{k}r1", pytest.approx(8 * 1e5 * (k + 1))) for k in range(4)}
    assert standby_cost.standby_bytes(report(1.0, 1.0), "shaped") == {}  # none without


class Canned:
    """`standby_cost.Runner` with canned reports; the runs it was asked for."""

    def __init__(self, with_: dict[str, Any], without: dict[str, Any]) -> None:
        self.reports = {True: with_, False: without}
        self.asked: list[bool] = []

    def __call__(self, standby: bool) -> dict[str, Any]:
        self.asked.append(standby)
        return self.reports[standby]


def test_the_bench_exits_1_when_the_target_is_missed(capsys: pytest.CaptureFixture[str]) -> None:
    missed = Canned(report(1.0, 2.3, True), report(1.0, 2.0))  # 15% slower at the link's rate
    assert standby_cost.main([], missed) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == (
        "FAIL: with a standby / without, median s/step unshaped 1.000, shaped 1.150 "
        "(target <= 1.05)"
    )
    assert "0: 0.80 MB, 1: 1.60 MB, 2: 2.40 MB, 3: 3.20 MB" in out[2]  # each standby's a step
    assert missed.asked == [True, False, False, True, True, False]  # alternated
    passed = Canned(report(1.01, 2.04, True), report(1.0, 2.0))
    assert standby_cost.main(["--pairs", "3"], passed) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("PASS: with a standby / without")
    with pytest.raises(SystemExit):
        standby_cost.main(["--pairs", "2"], passed)


def test_the_bench_exits_2_where_wan_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    def refused(standby: bool) -> dict[str, Any]:
        raise standby_cost.CannotRun("bench/wan.py: needs root (network namespaces, veth, ...)")

    assert standby_cost.main([], refused) == 2
    assert "needs root" in capsys.readouterr().err


# --- CPU seconds a step: what holds on a shared host -------------------------------------------


def with_cpu(run: dict[str, Any], cpu: dict[str, float]) -> dict[str, Any]:
    """`run` with wan.py's CPU seconds a step of each process, on both links."""
    return {**run, **{link: {**run[link], "cpu_seconds_per_step": cpu} for link in LINKS}}


LINKS = ("unshaped", "shaped")
TRAINER_CPU = 0.5


def one_replica(standby: bool) -> dict[str, Any]:
    """`report`'s runs with CPU: without, each stage's one server 1.0 s a step; with, its
    replica (`s<k>r0`, the standby's source) 1.1 and its standby 0.3."""
    cpu = {"trainer": TRAINER_CPU}
    for k in range(4):
        cpu |= {f"s{k}r0": 1.1, f"s{k}r1": 0.3} if standby else {f"stage{k}": 1.0}
    return with_cpu(report(1.0, 2.0, standby), cpu)


def test_the_cpu_cost_is_the_standbys_own_its_sources_and_the_swarms() -> None:
    cost = standby_cost.cpu_cost(one_replica(True), one_replica(False), "shaped")
    assert cost is not None
    assert cost.standby == {k: pytest.approx(0.3) for k in range(4)}
    assert cost.source == {k: pytest.approx(1.1) for k in range(4)}
    without = 4 * 1.0 + TRAINER_CPU
    assert cost.swarm == pytest.approx((4 * 1.4 + TRAINER_CPU) / without)
    assert cost.serving == pytest.approx((4 * 1.1 + TRAINER_CPU) / without)  # less the standbys
    assert cost.swarm_without == pytest.approx(without)
    # an older wan.py's reports: no figures, no cost
    assert standby_cost.cpu_cost(report(1.0, 2.0, True), report(1.0, 2.0), "shaped") is None


def test_in_a_pool_the_source_is_the_replica_that_sent_most_against_its_pools_mean() -> None:
    """Two replicas a stage and a standby (`s<k>r2`): the source sends the update on top of
    the averaging both replicas do; without a standby, the pool's two replicas' mean."""
    per_mb, cpu_with, cpu_without = {}, {"trainer": TRAINER_CPU}, {"trainer": TRAINER_CPU}
    for k in range(4):
        source = f"s{k}r{k % 2}"  # either replica may be
        for j in range(2):
            host = f"s{k}r{j}"
            per_mb[host] = {"sent": 5e5 + (1e5 if host == source else 0), "received": 5e5}
            cpu_with[host] = 1.3 if host == source else 1.2
            cpu_without[host] = 1.0 + 0.2 * j  # mean 1.1
        per_mb[f"s{k}r2"] = {"sent": 1e3, "received": 1e5}
        cpu_with[f"s{k}r2"] = 0.2
    without_mb = {h: m for h, m in per_mb.items() if not h.endswith("r2")}
    with_ = report(1.0, 2.0, True)
    without = report(1.0, 2.0)
    for link in LINKS:
        with_[link] |= {"bytes_per_microbatch": per_mb, "cpu_seconds_per_step": cpu_with}
        without[link] |= {"bytes_per_microbatch": without_mb, "cpu_seconds_per_step": cpu_without}
    assert standby_cost.sources(with_, "unshaped") == {k: f"s{k}r{k % 2}" for k in range(4)}
    cost = standby_cost.cpu_cost(with_, without, "unshaped")
    assert cost is not None
    assert cost.source == {k: pytest.approx(1.3 / 1.1) for k in range(4)}
    assert cost.standby == {k: pytest.approx(0.2) for k in range(4)}


def test_the_bench_prints_the_cpu_ratios_beside_the_walls(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert standby_cost.main([], Canned(one_replica(True), one_replica(False))) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[6:10] == ["CPU", "swarm", "serving", "source"]
    swarm, serving = (4 * 1.4 + 0.5) / 4.5, (4 * 1.1 + 0.5) / 4.5
    assert out[2].split()[5:9] == [f"{swarm:.3f}", f"{serving:.3f}", "1.100", "0.300"]
    assert (
        f"CPU a step, shaped, median of 3 pairs: swarm with/without {swarm:.3f}, serving (less "
        f"the standbys) {serving:.3f}, each standby's source 1.100; a standby's own 0.300 s "
        "(the swarm's without: 4.50 s)"
    ) in out
    # without CPU figures (an older wan.py), dashes and no CPU line
    assert standby_cost.main([], Canned(report(1.0, 2.0, True), report(1.0, 2.0))) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].split()[5:9] == ["-", "-", "-", "-"]
    assert not [line for line in out if line.startswith("CPU a step")]
