"""A stage whose only replicas do not answer the coordinator is reported as that, with who did
not answer and what fixes it: it used to read "no replica of stages [1] is at step 0", as if the
replica were behind (issue 42: a peer behind NAT, assigned, never dialled)."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.errors import PeerUnavailable, SwarmError
from swarm.job.fingerprint import fingerprint
from tests.support.coordinator import MakeHarness, job_of
from tests.support.replicas import FakeSwarm


async def test_a_stage_whose_only_replica_cannot_be_dialled_says_so_with_the_remedy(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a")
    nat = swarm.add(1, "n")
    refused = "UNAVAILABLE: failed to connect to all addresses; last error: Connection refused"
    for method in ("info", "load_state", "join", "max_state_tensors"):  # nothing gets through
        nat.fail(method, *(PeerUnavailable(refused) for _ in range(10)))
    h = make_harness(job, swarm)
    with pytest.raises(SwarmError) as raised:
        await h.coordinator.start()
    message = str(raised.value)
    assert "stage 1" in message and "n at fake:n" in message, message
    assert "did not answer" in message and "Connection refused" in message, message
    assert "--announce-host" in message and "relay" in message, message
