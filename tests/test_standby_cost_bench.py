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
