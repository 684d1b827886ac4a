"""`swarm.ops.poison`: what a hostile replica lies about, and when."""

from __future__ import annotations

import pytest
import torch

from swarm.errors import ConfigError
from swarm.ops.poison import ERROR, Kind, Poison, parse_poison


def test_a_poison_lies_at_its_steps_only_and_about_its_kind_only() -> None:
    poison = parse_poison("grads:20:2")
    assert poison == Poison(Kind.GRADS, 20, 2)
    t = torch.linspace(-1.0, 1.0, 12, dtype=torch.float64).reshape(3, 4)
    assert poison.grads(1, t) is t and poison.outputs(2, t) is t
    wrong = poison.grads(22, t)
    assert wrong is not None and torch.isfinite(wrong).all()
    gap = (wrong - t).abs()
    assert 0 < float(gap.max()) <= ERROR * (1 + 1e-9)
    # neither a shift nor a scaling, which a LayerNorm after the stage would undo
    assert float((wrong - t).std()) > 0 and float((wrong / t).std()) > 0
    assert parse_poison("activations").outputs(0, t) is not t
    assert Poison().outputs(0, t) is t and Poison().grads(0, None) is None


@pytest.mark.parametrize("text", ["weights", "grads:0", "grads:3:3", "grads:x", "grads:2:1:0"])
def test_a_malformed_poison_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="SWARM_POISON"):
        parse_poison(text)
