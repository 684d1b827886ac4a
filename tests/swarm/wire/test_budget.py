"""swarm.wire.budget: a process's bytes of received bodies, reserved per call and given back."""

from __future__ import annotations

import pytest

from swarm.errors import Busy, ConfigError, ResourceExhausted
from swarm.wire.budget import ReceiveBudget


def test_reservations_past_the_budget_are_refused_and_given_back_when_a_call_ends() -> None:
    budget = ReceiveBudget(100)
    with budget.hold() as first:
        first.reserve(60)
        with budget.hold(Busy) as second:
            with pytest.raises(Busy, match=r"60 of this process's 100 bytes .*--receive-budget"):
                second.reserve(41)
            second.reserve(40)  # exactly the rest
            assert budget.in_use == 100
            with pytest.raises(ResourceExhausted):
                first.reserve(1)
        assert budget.in_use == 60 and second.nbytes == 0
    assert budget.in_use == 0
    with pytest.raises(ResourceExhausted) as info, budget.hold() as held:
        held.reserve(101)  # more than the whole budget: refused, nothing held
    assert not isinstance(info.value, Busy) and budget.in_use == 0
    held.release()  # twice is harmless
    assert budget.in_use == 0


def test_a_budget_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="--receive-budget-bytes must be positive"):
        ReceiveBudget(0)
