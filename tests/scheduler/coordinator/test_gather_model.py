"""A whole model gathered from the replicas (`swarm export` of a running job) says why a stage
gave none: each replica's error with its cause, not its class alone ("['p1: PeerUnavailable']"
was all an export said)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.coordinator import gather_model
from swarm.errors import FailedPrecondition
from tests.support.coordinator import MakeHarness, started


async def test_a_stage_that_gave_no_state_names_each_replicas_cause(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    h = await started(tmp_path, make_harness, "a", "c")
    h.swarm["c"].dead = True  # SIGKILLed: every call refused
    with pytest.raises(FailedPrecondition) as e:
        await gather_model(h.coordinator, attempts=1)
    assert "no replica of stage 1 gave its state" in str(e.value)
    assert "c: PeerUnavailable: UNAVAILABLE: fake:c: Connection refused" in str(e.value)
