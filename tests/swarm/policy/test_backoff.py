"""The one retry pause: doubling from the first pause to the cap, jittered, and still at its cap
after a loop has failed for hours (a NAT'd peer with no relay to attach to pauses so forever)."""

from __future__ import annotations

import random

from swarm.policy.backoff import Backoff


def test_pauses_double_to_the_cap_jittered_by_a_fifth() -> None:
    backoff = Backoff(0.5, 30.0, rng=random.Random(1))
    bare = [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    for expected in bare:
        assert 0.8 * expected <= backoff.next() <= 1.2 * expected
    backoff.reset()
    assert backoff.peek() == 0.5


def test_a_loop_failing_for_hours_stays_at_the_cap() -> None:
    backoff = Backoff(0.5, 30.0)
    backoff.attempts = 5000  # 2.0**5000 is past a float's range
    assert backoff.peek() == 30.0 and 24.0 <= backoff.next() <= 36.0
