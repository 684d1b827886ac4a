"""bench/audit_cost.py's score on canned numbers (issue 69, item 4): the median of the pairs'
on/off ratios against 1.03, at least five pairs, and the bench's exit status follows it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import audit_cost


def test_the_median_ratio_is_the_score() -> None:
    # one outlier pair (a loaded moment) does not move the median
    pairs = [(1.02, 1.0), (2.0, 1.0), (1.01, 1.0), (0.99, 1.0), (1.03, 1.0)]
    scored = audit_cost.score(pairs)
    assert scored.ratios == pytest.approx([1.02, 2.0, 1.01, 0.99, 1.03])
    assert scored.median == pytest.approx(1.02)
    assert scored.passed


def test_a_median_over_three_percent_misses() -> None:
    scored = audit_cost.score([(1.05, 1.0), (1.04, 1.0), (1.0, 1.0), (1.06, 1.0), (1.2, 1.0)])
    assert scored.median == pytest.approx(1.05)
    assert not scored.passed
    assert audit_cost.score([(1.03, 1.0)] * 5).passed  # the bound itself is met


def test_fewer_than_five_pairs_or_a_bad_time_is_refused() -> None:
    with pytest.raises(ValueError, match="5 or more"):
        audit_cost.score([(1.0, 1.0)] * 4)
    with pytest.raises(ValueError, match="positive"):
        audit_cost.score([(1.0, 1.0)] * 4 + [(1.0, 0.0)])


class Canned:
    """`audit_cost.Runner` with canned seconds a step; the runs it was asked for."""

    def __init__(self, on: float, off: float) -> None:
        self.seconds = {0.045: on, 0.0: off}
        self.asked: list[tuple[int, float, int]] = []

    def __call__(self, steps: int, fraction: float, replicas: int) -> audit_cost.Run:
        self.asked.append((steps, fraction, replicas))
        return audit_cost.Run(self.seconds[fraction])


def test_the_bench_exits_1_when_the_target_is_missed(capsys: pytest.CaptureFixture[str]) -> None:
    missed = Canned(on=1.1, off=1.0)  # audits on: 10% more a step
    assert audit_cost.main(["--pairs", "5"], missed) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == "FAIL: audits on/off median 1.100 (target <= 1.03)"
    # alternated, on first then off first; three replicas a stage by default
    assert [f for _, f, _ in missed.asked[:4]] == [0.045, 0.0, 0.0, 0.045]
    assert {r for _, _, r in missed.asked} == {3}
    assert audit_cost.main(["--pairs", "5"], Canned(on=1.01, off=1.0)) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("PASS: audits on/off median 1.010")
    with pytest.raises(SystemExit):
        audit_cost.main(["--pairs", "4"], Canned(on=1.0, off=1.0))
