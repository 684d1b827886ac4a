"""`stage_server.averaging.hostile`: the averaging poisoners `SWARM_FAULTS` arms, lying at their
steps only (a period included), as the system tests and benchmarks count on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from stage_server.averaging.hostile import ERROR, poison
from stage_server.averaging.owner import Averager
from swarm.ops.faults import arm
from swarm.wire.codec import CODEC_NONE


@pytest.fixture
def armed() -> Iterator[None]:
    yield
    arm("")


def test_a_bent_contribution_stays_within_the_norm_bound_and_is_no_scaling(armed: None) -> None:
    arm("poison-bent@2")
    honest = torch.randn(1000, dtype=torch.float64)
    flat = honest.clone()
    poison(flat, Averager(), 1)
    assert torch.equal(flat, honest)  # before its step
    poison(flat, Averager(), 2)
    assert torch.isfinite(flat).all() and not torch.equal(flat, honest)
    assert float(flat.norm()) <= 2 * float(honest.norm())  # within the default bound of 8
    assert float((flat / honest).std()) > 0.1  # not a scaling, which Adam would half undo


def test_a_sum_poisoner_lies_at_its_period_s_steps_only(armed: None) -> None:
    arm("poison-sum@1/3")
    averager, values = Averager(), [torch.ones(4), torch.ones(4)]

    def summed(step: int) -> torch.Tensor:
        poison(torch.zeros(4), averager, step)
        return averager.summer([v.clone() for v in values], [False, False], CODEC_NONE, 4).tensor

    assert torch.equal(summed(0), torch.full((4,), 2.0))
    assert torch.equal(summed(1), torch.full((4,), 2.0 + ERROR))
    assert torch.equal(summed(2), torch.full((4,), 2.0))  # honest again between its steps
    assert torch.equal(summed(4), torch.full((4,), 2.0 + ERROR))
