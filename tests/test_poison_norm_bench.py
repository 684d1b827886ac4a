"""bench/poison_norm.py's judgement on canned results (issue 65): the x1e4 row with the norm
bound past 2% of the honest loss, a bound that refused nothing, or a run under 100 steps each
fail it (exit status 1); the rows the bound lets through by design are not judged."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import poison_norm


def _results(bounded: float, refused: int) -> dict[str, tuple[float, int]]:
    return {
        "honest": (2.0, 0),
        "x10000, clip off": (2.2, 0),
        "x10000, norm_bound": (bounded, refused),
        "bent, norm_bound": (2.3, 0),  # let through by design: printed, not judged
        "wrong compute, bound": (2.1, 0),
    }


def test_within_two_percent_with_the_bound_having_judged_passes() -> None:
    assert poison_norm.judge(_results(2.039, 40), 1e4, 100) == []
    assert poison_norm.report([]) == 0


@pytest.mark.parametrize(
    ("loss", "refused", "steps", "why"),
    [
        (2.041, 40, 100, "1.0205x the honest loss, past 1.02x"),
        (float("nan"), 40, 100, "nanx the honest loss"),
        (2.0, 0, 100, "the bound refused nothing"),
        (2.0, 40, 12, "12 steps: under the 100"),
    ],
)
def test_a_missed_target_fails(loss: float, refused: int, steps: int, why: str) -> None:
    missed = poison_norm.judge(_results(loss, refused), 1e4, steps)
    assert len(missed) == 1 and why in missed[0], missed
    assert poison_norm.report(missed) == 1
