"""`stage_server.averaging.hostile`: the averaging poisoners `SWARM_FAULTS` arms, lying at their
steps only (a period included), as the system tests and benchmarks count on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from stage_server.averaging.hostile import ERROR, misreport, poison
from stage_server.averaging.owner import Averager
from swarm.ops.faults import arm
from swarm.proto import stage_pb2 as pb
from swarm.wire.codec import CODEC_NONE

ONE = [slice(0, 1000)]  # a round of one: its own part is the whole


@pytest.fixture
def armed() -> Iterator[None]:
    yield
    arm("")


def test_a_bent_contribution_stays_within_the_norm_bound_and_is_no_scaling(armed: None) -> None:
    arm("poison-bent@2")
    honest = torch.randn(1000, dtype=torch.float64)
    flat = honest.clone()
    poison(flat, Averager(), 1, ONE, 0)
    assert torch.equal(flat, honest)  # before its step
    poison(flat, Averager(), 2, ONE, 0)
    assert torch.isfinite(flat).all() and not torch.equal(flat, honest)
    assert float(flat.norm()) <= 2 * float(honest.norm())  # within the default bound of 8
    assert float((flat / honest).std()) > 0.1  # not a scaling, which Adam would half undo


def test_a_sum_poisoner_lies_at_its_period_s_steps_only(armed: None) -> None:
    arm("poison-sum@1/3")
    averager, values = Averager(), [torch.ones(4), torch.ones(4)]

    def summed(step: int) -> torch.Tensor:
        poison(torch.zeros(4), averager, step, ONE, 0)
        return averager.summer([v.clone() for v in values], [False, False], CODEC_NONE, 4).tensor

    assert torch.equal(summed(0), torch.full((4,), 2.0))
    assert torch.equal(summed(1), torch.full((4,), 2.0 + ERROR))
    assert torch.equal(summed(2), torch.full((4,), 2.0))  # honest again between its steps
    assert torch.equal(summed(4), torch.full((4,), 2.0 + ERROR))


def test_a_nan_liar_sends_the_next_owner_a_nan_and_reports_finite_words(armed: None) -> None:
    """`lie-nan`: the NaN lands in the part of the member after it (only that owner sees it),
    and its reports of that part say finite values where an honest sender's would be NaN; its
    own part, and every report of another part, stay as they were."""
    arm("lie-nan@1")
    parts = [slice(0, 4), slice(4, 8), slice(8, 12)]
    flat = torch.ones(12, dtype=torch.float64)
    poison(flat, Averager(), 0, parts, 2)
    assert torch.isfinite(flat).all()  # before its step
    poison(flat, Averager(), 1, parts, 2)
    assert [i for i in range(12) if flat[i].isnan()] == [0]  # part 0: the member after 2
    nan = float("nan")
    said = [
        pb.SumCheck(part=0, dot=nan, magnitude=nan, norm=nan, sum_dot=nan),
        pb.SumCheck(part=1, dot=1.5, magnitude=2.0, norm=3.0, sum_dot=nan),
        pb.SumCheck(part=2, dot=0.5, magnitude=1.0, norm=2.0, sum_dot=nan),
    ]
    assert misreport(said, 2, 0) == tuple(said)  # honest before its step
    lied = misreport(said, 2, 1)
    assert (lied[0].dot, lied[0].magnitude, lied[0].norm) == (0.0, 0.0, 2.0)
    assert lied[0].sum_dot != lied[0].sum_dot  # what it took back: as it was (NaN)
    assert lied[1:] == tuple(said[1:])
