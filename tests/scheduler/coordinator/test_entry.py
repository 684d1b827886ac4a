"""New peers enter a job's pools at a bounded rate (issue 64, item 3): a liar banned under one
id and back under fresh ones costs the job at most a bounded number of bans a stage an hour,
while a job's honest growth (a few machines a stage at once) joins as it comes, and former
members come back whatever the rate."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.coordinator.entry import ENTRY_BURST, ENTRY_EVERY_S, Entry
from swarm.clock import FakeClock
from swarm.job.fingerprint import fingerprint
from tests.support.coordinator import Harness, job_of, until
from tests.support.replicas import FakeSwarm


@pytest.mark.attack("64-entry")
async def test_fresh_ids_enter_a_stage_at_a_bounded_rate(tmp_path: Path) -> None:
    """Twenty fresh ids announced for stage 0 of a running job all joined at its next step
    boundary: with the shared token a banned liar came back as often as it liked, each time
    costing the job a rollback. Now `ENTRY_BURST` join at once, then one each `ENTRY_EVERY_S`,
    and each held one says so."""
    job = job_of(tmp_path, steps=50)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a"), swarm.add(1, "c")
    h = Harness(job, swarm)
    try:
        await h.coordinator.start()
        await h.step()  # a and c are the job's members now
        fresh = [f"sybil-{i}" for i in range(20)]
        for peer in fresh:
            swarm.add(0, peer)
        membership = h.coordinator.membership

        def joined() -> list[str]:
            return [p for p in fresh if p in membership.synced]

        await h.step()
        await until(lambda: len(joined()) >= ENTRY_BURST)
        await h.step()  # another boundary: none more, the rate spent
        await until(lambda: not membership.copying())
        assert len(joined()) == ENTRY_BURST, joined()
        waits = membership.waits()
        held = [p for p in fresh if p not in joined()]
        assert all(waits[p].startswith("waiting its turn to enter stage 0") for p in held), waits
        h.clock.advance(ENTRY_EVERY_S)  # one more entry
        await h.step()
        await until(lambda: len(joined()) == ENTRY_BURST + 1)
        await h.step()
        await until(lambda: not membership.copying())
        assert len(joined()) == ENTRY_BURST + 1
    finally:
        await h.coordinator.close()


def test_known_peers_and_those_let_in_enter_freely_and_the_rate_refills() -> None:
    clock = FakeClock()
    members = {"old"}
    entry = Entry(clock, members.__contains__, burst=2, every_s=10.0)
    assert entry.admits(0, "n1") and entry.admits(0, "n2")
    assert not entry.admits(0, "n3") and entry.held == {"n3": 0}
    assert entry.admits(0, "old") and entry.admits(0, "n1")  # a member before; one let in
    assert entry.admits(1, "m1")  # each stage its own rate
    assert "the next in 10 s" in entry.why(0)
    clock.advance(10.0)
    assert entry.admits(0, "n3") and entry.held == {}
    assert not entry.admits(0, "n4")
    entry.forget({"n1"})  # n4 left; n2 and n3 too: they would spend an entry again
    assert entry.held == {}
    clock.advance(1000.0)  # refilled to the burst, no more
    assert entry.admits(0, "a") and entry.admits(0, "b") and not entry.admits(0, "c")
