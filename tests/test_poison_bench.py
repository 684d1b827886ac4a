"""bench/poison.py's scoring on canned results (issue 65): a liar's poisoned steps are read from
its ban's record, a trial waits for every hostile replica that can lie (a fourth liar too), every
ban of a replica that is not hostile fails the attack, as do a liar caught late or never and a
replay more than 1e-9 from `swarm local`; the audits' wall-time cost is the median of at least 5
interleaved pairs or not printed; any missed target is exit status 1."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import poison


def test_steps_to_catch_are_read_from_the_bans_record() -> None:
    # lied at steps 0..2 (committed), caught at step 3 where it lied: 4 poisoned steps
    assert poison.steps_to_catch([0, 1, 2], {0, 1, 2, 3}, 3) == 4
    # caught at a step it told no lie at (as an auditor of a step it was honest in): not one
    # more poisoned step, as the old count (committed + 1, "the next one") assumed
    assert poison.steps_to_catch([0, 1, 2], {0, 1, 2}, 5) == 3
    # a step replayed after another liar's rollback, lied at again, counts again
    assert poison.steps_to_catch([0, 1, 0, 1], {0, 1, 2}, 2) == 5
    assert poison.steps_to_catch([0, 1], {0, 1}, None) is None  # never caught


def test_a_trial_waits_for_every_replica_that_can_lie() -> None:
    def able(attack: str) -> list[int]:
        return [k for k in range(poison.STAGES) if poison.can_lie(attack, k)]

    assert able("poison-outputs@0") == [0, 1, 2]  # the last stage sends no outputs
    assert able("poison-sent-outputs@1/20") == [0, 1, 2]
    assert able("poison-grad-inputs@0") == [1, 2, 3]  # stage 0 answers no input gradient
    assert able("poison-digest@0") == [0, 1, 2, 3]  # four liars: not cut off at three bans
    assert able("") == []  # the honest job


def _attack(counts: list[int | None], vs_local: float = 5e-11, bans: int = 0) -> poison.Attack:
    honest_bans = [f"trial 0: 127.0.0.1:{5000 + i} (stage 1) at step 3: x" for i in range(bans)]
    return poison.Attack("poison-outputs@0", 3, 32, 0.045, counts, vs_local, honest_bans)


def test_an_attack_whose_liars_are_all_caught_in_time_and_replayed_exactly_passes() -> None:
    result = _attack([1, 2, 10, 1, 1, 3, 4, 1, 2])
    assert result.missed() == []
    assert result.line().split()[1:4] == ["3", "9", "1.00"]
    assert result.line().split()[-1] == "0"  # the honest bans' column


@pytest.mark.parametrize(
    ("counts", "vs_local", "bans", "why"),
    [
        ([1, 2, 11], 5e-11, 0, "1 of 3 liars not caught within 10 poisoned steps at 32"),
        ([1, None, 3], 5e-11, 0, "1 of 3 liars not caught within 10"),
        ([1, 2, 3], 2e-9, 0, "the replayed result is 2.0e-09 from `swarm local`"),
        ([1, 2, 3], math.nan, 0, "the replayed result is nan from `swarm local`"),
        ([1, 2, 3], 5e-11, 1, "1 ban(s) of a replica that was not hostile"),
        ([], 5e-11, 0, "no hostile replica told a lie"),
    ],
)
def test_an_attack_that_misses_a_target_fails(
    counts: list[int | None], vs_local: float, bans: int, why: str
) -> None:
    missed = _attack(counts, vs_local, bans).missed()
    assert len(missed) == 1 and why in missed[0], missed
    assert poison.report(missed, 32) == 1


def test_the_audits_wall_time_is_the_median_of_five_interleaved_pairs_or_not_printed() -> None:
    kept = poison.Honest(1000, [(10.0, 11.0), (10.0, 9.0), (10.0, 10.5), (10.0, 30.0)])
    assert kept.ratio() is None  # four pairs: no figure
    assert "wall time not measured (4 pair(s), fewer than 5)" in kept.line()
    kept.seconds.append((10.0, 10.2))
    assert kept.ratio() == pytest.approx(1.05)  # the median: not the outlier, not the first
    assert "wall time 1.05x the run without audits (median of 5 interleaved pairs)" in kept.line()
    assert kept.missed() == []
    kept.accused.append("pair 2: 127.0.0.1:5001 (stage 2) at step 7: x")
    assert kept.missed() and poison.report(kept.missed(), 32) == 1


def test_every_target_met_is_exit_status_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert poison.report([], 32) == 0
    assert "PASS every target" in capsys.readouterr().out
    assert poison.report([], 4) == 0  # judged alike, and said to be under the stated count
    assert "under the 32 the catch target is stated for" in capsys.readouterr().out
