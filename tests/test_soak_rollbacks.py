"""bench/soak.py's rollbacks target on canned counts (issue 67): with a standby, a stage killed
whole must roll nothing back (its standby is promoted), so one rollback fails the soak, which
then exits 1; without one, a rollback a whole-stage kill is what the job does."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import soak


def test_with_a_standby_one_rollback_fails_the_soak() -> None:
    ok, said = soak.rollbacks_target(0, 0.0, 1, 1, 1)
    assert ok and said == (
        "0 logged, 0 counted; 1 whole-stage kills, 1 standbys promoted; standby 1: none expected"
    )
    assert not soak.rollbacks_target(1, 1.0, 1, 1, 0)[0]  # the standby was behind, or lost
    assert not soak.rollbacks_target(0, 1.0, 1, 1, 1)[0]  # counted, though not logged
    assert not soak.rollbacks_target(1, 0.0, 1, 1, 1)[0]  # logged, though not counted


def test_without_a_standby_a_rollback_a_whole_stage_kill_passes() -> None:
    assert soak.rollbacks_target(1, 1.0, 1, 0, 0) == (
        True,
        "1 logged, 1 counted; 1 whole-stage kills",
    )
    assert not soak.rollbacks_target(2, 2.0, 1, 0, 0)[0]
    assert not soak.rollbacks_target(1, 1.0, 0, 0, 0)[0]  # no kill: no rollback is due


def report(rollbacks: tuple[bool, str]) -> dict[str, Any]:
    """A soak's report whose targets all pass but, as given, its rollbacks'."""
    targets = {"progress": (True, "10 steps"), "rollbacks": rollbacks}
    return {
        "minutes": 12.0,
        "seed": 0,
        "peers": 7,
        "stages": 3,
        "work_dir": "/tmp/soak",
        "events": [{"kind": "stage", "t": 300.0, "peers": ["p1", "p2"], "settled_s": 4.0}],
        "steps": 10,
        "steps_per_s": 0.1,
        "steps_per_s_after_warmup": 0.1,
        "longest_stall_s": 9.0,
        "first_step_s": 30.0,
        "growth": {},
        "checks": [],
        "rollbacks": {"logged": 1, "metric": 1.0, "stage_kills": 1, "promoted": 0},
        "rebalancing_moves": 0,
        "scheduler_notes": [],
        "problems": [],
        "targets": {k: {"pass": ok, "detail": d} for k, (ok, d) in targets.items()},
        "pass": all(ok for ok, _ in targets.values()),
    }


def test_the_report_says_fail_and_the_soak_exits_1_on_a_rollback_with_a_standby(
    capsys: pytest.CaptureFixture[str],
) -> None:
    r = report(soak.rollbacks_target(1, 1.0, 1, 1, 0))
    soak.print_report(r)
    out = capsys.readouterr().out.splitlines()
    assert "rollbacks: 1 logged, 1 counted, 1 whole-stage kills, 0 standbys promoted" in out
    assert out[-2].startswith("FAIL rollbacks") and out[-1] == "FAIL"
    assert soak.exit_status(r) == 1
    assert soak.exit_status(report(soak.rollbacks_target(0, 0.0, 1, 1, 1))) == 0
