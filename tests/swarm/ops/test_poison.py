"""`swarm.ops.poison`: what a hostile replica lies about in its stage compute, and when (its
`SWARM_FAULTS` hostile points, parsed by `swarm.ops.faults` as every other fault)."""

from __future__ import annotations

import pytest
import torch

from swarm.errors import ConfigError
from swarm.ops.faults import Fault, FaultPlan, Point, arm, parse_faults
from swarm.ops.poison import ERROR, Poison


def test_a_poison_lies_at_its_steps_only_and_about_its_kind_only() -> None:
    poison = Poison.of(parse_faults("poison-grad-inputs@2/20,backward@5"))
    assert poison == Poison((Fault("", Point.POISON_GRAD_INPUTS, 2, 20),))
    t = torch.linspace(-1.0, 1.0, 12, dtype=torch.float64).reshape(3, 4)
    assert poison.grads(1, t) is t and poison.outputs(2, t) is t
    assert poison.grads(21, t) is t and poison.grads(2, t) is not t
    wrong = poison.grads(22, t)
    assert wrong is not None and torch.isfinite(wrong).all()
    gap = (wrong - t).abs()
    assert 0 < float(gap.max()) <= ERROR * (1 + 1e-9)
    # neither a shift nor a scaling, which a LayerNorm after the stage would undo
    assert float((wrong - t).std()) > 0 and float((wrong / t).std()) > 0
    every = Poison.of(parse_faults("poison-outputs@3"))
    assert every.outputs(2, t) is t and every.outputs(3, t) is not t
    assert every.outputs(1000, t) is not t
    assert Poison().outputs(0, t) is t and Poison().grads(0, None) is None


def test_a_digest_poison_moves_only_the_dot_of_an_audit_digest_at_its_steps() -> None:
    """`poison-digest`: the gradient digest an auditor answers, q·g moved by ERROR of
    Σ|q_i·g_i| (far above its rounding), its ‖g‖ and Σ|q_i·g_i| as they are; nothing else."""
    poison = Poison.of(parse_faults("poison-digest@2"))
    honest = (0.25, 8.0, 3.0)
    assert poison.digest(1, honest) == honest and poison.digest(2, None) is None
    assert poison.digest(2, honest) == (0.25 + ERROR * 8.0, 8.0, 3.0)
    t = torch.ones(3, dtype=torch.float64)
    assert poison.outputs(2, t) is t and poison.grads(2, t) is t
    assert Poison.of(parse_faults("poison-outputs@0")).digest(5, honest) == honest


def test_a_process_poison_is_its_swarm_faults() -> None:
    try:
        arm("poison-outputs@1/3,averaging-oom@4")
        assert Poison.armed() == Poison((Fault("", Point.POISON_OUTPUTS, 1, 3),))
        planned = parse_faults("s1r0:poison-outputs@1/3,s1r1:poison-sum@2")
        assert FaultPlan.for_process(planned, "s1r0") == "poison-outputs@1/3"  # a child's
    finally:
        arm("")


@pytest.mark.parametrize(
    "text",
    [
        "poison-weights@1",
        "poison-grad-inputs@x",
        "poison-outputs@2/0",
        "poison-outputs@2/x",
        "poison-outputs@2/3/4",
        "backward@2/3",  # a period only at a hostile point: a process dies once
    ],
)
def test_a_malformed_poison_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="SWARM_FAULTS"):
        arm(text)
