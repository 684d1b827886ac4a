"""A replica whose receipts still do not match the ledger after it was voided is dropped, not
voided again at every retry: one that lists a receipt no trainer reported, whatever it is told
to discard (a hostile stage server, or an honest one whose Discard keeps being refused), held
its step's commit in a loop of voids, a WARNING each, with no bound (`max_commit_rounds` counts
failed PREPARE rounds, and none was reached). In-memory replicas (`tests.support.replicas`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.proto import stage_pb2 as pb
from swarm.rpc.lease import Task
from tests.support.coordinator import LEASE_S, Harness, MakeHarness, job_of
from tests.support.replicas import FakeSwarm

pytestmark = pytest.mark.timeout(60)


async def _a_lease_run_out(
    make_harness: MakeHarness, job: JobConfig, swarm: FakeSwarm
) -> tuple[Harness, Task]:
    """A step of two microbatches: the first run on a, the other's lease run out (the step is
    suspect: its commit looks at every replica's receipts) and leased again to "u"."""
    h = make_harness(job, swarm)
    await h.coordinator.start()
    first, _ = await h.lease()
    await h.run(first, {0: "a"})
    h.clock.advance(LEASE_S + 1)
    (again,) = await h.lease("u")
    return h, again


async def test_a_replica_whose_receipts_never_match_is_dropped_and_the_step_commits(
    tmp_path: Path, make_harness: MakeHarness, caplog: pytest.LogCaptureFixture
) -> None:
    job = job_of(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, b, c = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    honest = a.honest_info

    def phantom() -> pb.StageInfoResponse:  # a receipt nobody reported, never discarded
        info = honest()
        info.receipts.append(7)
        return info

    a.honest_info = phantom  # type: ignore[method-assign]
    h, again = await _a_lease_run_out(make_harness, job, swarm)
    await h.run(again, {0: "b"}, trainer="u")
    record = await h.replayed({0: "b"}, trainer="u")  # what a's voids give back, on b
    assert record.step == 0 and record.samples == 8
    assert not a.called("prepare"), "the step committed without it (it may rejoin after)"
    assert b.called("prepare")[-1].microbatches == [0, 1]
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    dropped = [m for m in said if "a (stage 0)" in m and "dropped" in m]
    assert len(dropped) == 1 and "still lists [7] after its void" in dropped[0], said
    del c


async def test_a_stragglers_new_receipt_at_the_next_look_is_voided_not_dropped(
    tmp_path: Path, make_harness: MakeHarness, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica voided for one stray receipt that lists another at the next look (a straggling
    trainer's second microbatch, landed meanwhile) is voided again: its void took."""
    job = job_of(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    a = swarm.add(0, "a")
    swarm.add(0, "b")
    swarm.add(1, "c")
    honest, strays = a.honest_info, list[list[int]]()

    def straggling() -> pb.StageInfoResponse:  # one stray at each of two looks, then none
        info = honest()
        info.receipts.extend(strays.pop(0) if strays else [])
        return info

    a.honest_info = straggling  # type: ignore[method-assign]
    h, again = await _a_lease_run_out(make_harness, job, swarm)
    strays.extend([[7], [8]])  # from the commit's looks on
    await h.run(again, {0: "b"}, trainer="u")
    assert (await h.replayed({0: "b"}, trainer="u")).step == 0
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert not [m for m in said if "dropped" in m], said
    assert len(a.called("discard")) >= 2, "voided at each of the two looks"
