"""`client.outage` alone, on a hand-moved clock: since when the scheduler is silent, the pauses
between asks, the bound, and what the views say."""

from __future__ import annotations

import math
import time

from client.outage import Outage
from swarm.clock import FakeClock
from swarm.policy.backoff import Backoff


def test_an_outage_is_timed_from_its_first_unanswered_ask_and_ends_when_one_is_answered() -> None:
    clock = FakeClock(1_000_000.0)
    outage = Outage(60.0, clock=clock.now, backoff=Backoff(first_s=1.0, cap_s=4.0, jitter=0.0))
    assert outage.answered() is None  # no outage yet
    assert [outage.failed() for _ in range(4)] == [1.0, 2.0, 4.0, 4.0]  # capped
    since = time.strftime("%H:%M:%S", time.localtime(clock.t))
    clock.advance(15)
    assert outage.text() == f"scheduler unreachable since {since} (15 s): retrying"
    assert outage.answered() == 15.0
    assert outage.failed() == 1.0  # a new outage starts its pauses afresh


def test_it_gives_up_after_its_bound_and_a_watch_never_does() -> None:
    clock = FakeClock(1_000_000.0)
    outage = Outage(60.0, clock=clock.now)
    assert outage.failed() is not None
    clock.advance(59)
    assert outage.failed() is not None
    clock.advance(1)
    assert outage.failed() is None
    assert outage.gave_up() == "no answer for 1m00s (--retry-for): giving up"
    forever = Outage(math.inf, clock=clock.now)
    forever.failed()
    clock.advance(10**7)
    assert forever.failed() is not None
