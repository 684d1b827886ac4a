"""A replica that refuses every PREPARE is left out, not voided at every round until the job
fails: a refusal (FailedPrecondition: "receipts it does not hold", a stale step) only voided
it, it stayed a member, and the others' accusations were skipped for its stage; after
`max_commit_rounds` the job failed (`CommitStalled`), where a hostile replica is to cost one
round and a replay. A replica refusing once (a straggler's receipt it held) is voided, as
before. In-memory replicas (`tests.support.replicas`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.errors import FailedPrecondition
from swarm.job.fingerprint import fingerprint
from tests.support.coordinator import MakeHarness, job_of
from tests.support.replicas import FakeSwarm

pytestmark = pytest.mark.timeout(60)


async def test_a_replica_refusing_every_prepare_is_left_out_and_the_step_commits(
    tmp_path: Path, make_harness: MakeHarness, caplog: pytest.LogCaptureFixture
) -> None:
    job = job_of(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    a = swarm.add(0, "a")
    swarm.add(0, "b")
    swarm.add(1, "c")
    a.fail("prepare", *(FailedPrecondition("a refuses, whatever it holds") for _ in range(50)))
    h = make_harness(job, swarm)
    await h.coordinator.start()
    record = await h.replayed({0: "b"})  # no job error meanwhile (CommitStalled, before)
    assert record.step == 0 and record.samples == 8
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("leaving a out" in m for m in said), said
    assert len(a.called("prepare")) <= 3, "left out after its second refusal"
