"""Issue 55: a stage server (its own process) that answers finite wrong activations or wrong
input gradients, every step or one step in 20, in a float64 job of three stages of three
replicas. The audits (`[trust] audit_fraction`, every microbatch here so the catch is certain;
the sampler itself is tested in tests/client/data_plane/test_audit.py) re-execute its work on
another replica, a second one arbitrates, the liar is banned with the evidence in the log, the
job rolls back to before its first step and replays without it: the final model equals
`swarm local`'s within 1e-9."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.liars import assert_caught_and_replayed_away

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "poison",
    [
        pytest.param("activations", marks=pytest.mark.attack("P-acts")),
        pytest.param("grads", marks=pytest.mark.attack("P-grads")),
        # one step in 20: the job's step 2 (its third) is the only one it lies at
        pytest.param("activations:20:2", marks=pytest.mark.attack("P-acts")),
        pytest.param("grads:20:2", marks=pytest.mark.attack("P-grads")),
    ],
)
def test_a_replica_that_lies_is_caught_banned_and_replayed_away(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, poison: str
) -> None:
    assert_caught_and_replayed_away(tmp_path, caplog, "relay", poison, "re-executed")
