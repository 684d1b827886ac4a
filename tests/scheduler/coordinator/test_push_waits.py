"""The late-receipt check's waits for pushes still in flight (`scheduler.coordinator.push_waits`):
once a microbatch, a stage and a ledger, at most the push's deadline, and a ledger that waits
pauses only its own checks."""

from __future__ import annotations

import pytest

from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.push_waits import PushWaits
from swarm.clock import FakeClock

WAIT_S = 6.0


def _ledger(clock: FakeClock, step: int = 0) -> StepLedger:
    return StepLedger(step=step, microbatches=4, stages=2, lease_timeout_s=10, clock=clock)


async def test_a_wait_is_once_a_stage_within_its_deadline_and_pauses_its_ledger_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    waits, a, b = PushWaits(WAIT_S), _ledger(clock), _ledger(clock, 1)
    assert waits.flying(a, {1: {1: {"c"}}}, [a, b]) == {1}
    assert waits.paused(a) and not waits.paused(b)  # b's late receipts are checked meanwhile
    clock.advance(WAIT_S - 0.1)
    assert waits.flying(a, {1: {1: {"c"}}}, [a, b]) == {1}
    # the replay of stage 0, overloaded at that stage in turn: a wait of its own
    assert waits.flying(a, {1: {0: {"d"}}}, [a, b]) == {1}
    clock.advance(0.1)
    assert waits.flying(a, {1: {1: {"c"}}}, [a, b]) == set()  # its deadline: leased again
    assert waits.flying(a, {1: {1: {"c"}}}, [a, b]) == set()  # and never again this ledger
    assert caplog.text.count("microbatch 1 is still being pushed at c (stage 1) after") == 1
    assert waits.flying(a, {1: {0: {"d"}}}, [a, b]) == {1}  # stage 0's wait is still on


async def test_a_rollbacks_ledger_of_the_same_step_waits_afresh() -> None:
    clock = FakeClock()
    waits, old = PushWaits(WAIT_S), _ledger(clock)
    assert waits.flying(old, {1: {1: {"c"}}}, [old]) == {1}
    clock.advance(WAIT_S)
    assert waits.flying(old, {1: {1: {"c"}}}, [old]) == set()
    new = _ledger(clock)  # the step opened again after a rollback
    assert waits.flying(new, {1: {1: {"c"}}}, [new]) == {1}
    assert not waits.paused(old)  # the old ledger's waits went with it
