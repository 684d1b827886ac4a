"""Placement and the job's bans: a peer banned from a job is no member of it (its coordinators
leave it out), so a stage only it serves has no replica, and it is given no stage of the job.
Placement counted it all the same: a job whose stage only a banned peer served was never placed
again, and its start failed at every attempt (a review found it)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from scheduler.service import Scheduler, SchedulerOptions
from scheduler.store import JobStore
from scheduler.store_bans import BanRow
from swarm.clock import FakeClock
from swarm.deadline import within
from swarm.net.peer_names import BarredIds
from swarm.proto import control_pb2 as cpb
from tests.support.fakes import SilentBus
from tests.support.placement import measured, placement
from tests.support.waiting import wait_until

TIMEOUT_S = 60.0


def _serving(peer: str, stage: int, speeds: dict[int, float] | None = None) -> cpb.PeerAnnouncement:
    return cpb.PeerAnnouncement(
        peer=peer,
        address=f"{peer}:1",
        job="j",
        stage=stage,
        state=cpb.PEER_STATE_SERVING,
        samples_per_second=speeds or {0: 5.0},
        incarnation="1",
    )


def _load(peer: str, speed: float) -> cpb.LoadReport:
    """What `peer` measures where it serves: `speed` samples/s."""
    return cpb.LoadReport(
        peer=peer, job="j", stage=1 if peer == "p" else 0, ema_seconds_per_sample=1.0 / speed
    )


async def test_a_stage_only_a_banned_peer_serves_is_placed_again_and_it_is_given_nothing() -> None:
    registry, assignments = placement(FakeClock(), TIMEOUT_S)
    assignments.banned = lambda job: {"x", "z"} if job == "j" else set()
    registry.announce(_serving("x", 0))  # serves stage 0, banned
    registry.announce(measured("z"))  # free and measured, banned
    registry.announce(measured("y"))
    assert assignments.available("j", 1) == {"y": [5.0]}
    given: list[str] = []
    placing = asyncio.create_task(assignments.place("j", 1, lambda: 0, given))
    try:
        await wait_until(lambda: given == ["y"], "y given stage 0", timeout_s=5)
        registry.announce(_serving("y", 0))
        assignments.changed.set()
        await within(placing, 5.0)
    finally:
        placing.cancel()
        await asyncio.gather(placing, return_exceptions=True)
    assert given == ["y"]


async def test_a_banned_peers_throughput_does_not_keep_a_replacement_from_its_stage() -> None:
    """Two stages; stage 1 is served by a banned peer alone, faster than stage 0's: counting its
    throughput, placement sent the free peer to stage 0 (a review found it), and stage 1 went on
    without a replica."""
    registry, assignments = placement(FakeClock(), TIMEOUT_S)
    assignments.banned = lambda job: {"p"}
    registry.announce(_serving("a", 0, speeds={0: 5.0, 1: 5.0}))
    registry.announce(_serving("p", 1, speeds={0: 10.0, 1: 10.0}))  # banned
    registry.announce(measured("q", speeds={0: 5.0, 1: 5.0}))
    for peer, speed in (("a", 5.0), ("p", 10.0)):
        registry.report_load(_load(peer, speed))
    given: list[str] = []
    await assignments._assign_available("j", assignments.available("j", 2), given, 1)
    assert given == ["q"] and registry.given("j", "q") == 1


async def test_where_ids_bind_credentials_a_banned_invites_other_ids_are_given_nothing() -> None:
    """With the broker binding ids to certificates, a ban of `gpu1.alice` bars every id of
    alice's invite from the job (its coordinators leave them out): placement gave `gpu2.alice`
    a stage all the same, and counted the stage `gpu3.alice` serves as served, replicas its
    coordinator would never count (a review found it). With the shared token alone another id
    is another peer, audited again: it is placed and counted."""
    for binds in (True, False):
        registry, assignments = placement(FakeClock(), TIMEOUT_S)
        assignments.banned = lambda job, b=binds: BarredIds(b, ["gpu1.alice"])  # type: ignore[misc]
        registry.announce(_serving("gpu3.alice", 0))
        registry.announce(measured("gpu2.alice"))
        registry.announce(measured("bob"))
        free = sorted(assignments.available("j", 1))
        assert free == (["bob"] if binds else ["bob", "gpu2.alice"]), (binds, free)
        assert set(assignments._serving("j", 1)) == (set() if binds else {0}), binds


@pytest.mark.parametrize("binds", [True, False])
def test_the_scheduler_places_by_the_bans_its_coordinators_keep(
    tmp_path: Path, binds: bool
) -> None:
    """The scheduler's placement reads the job's kept bans by the coordinators' rule: where ids
    bind credentials (`bans_bind_credentials`), a kept ban of `gpu1.alice` bars `gpu2.alice`."""
    with JobStore(tmp_path / "jobs.sqlite") as store:
        job = store.create("j", "", "/", 9).id
        store.record_ban(job, BanRow("gpu1.alice", 1, 0, 0, "its outputs differ"))
        opts = SchedulerOptions(tmp_path / "ckpt", bans_bind_credentials=binds)
        scheduler = Scheduler(store, SilentBus(), opts)  # type: ignore[arg-type]
        barred = scheduler.assignments.banned(job)
        assert "gpu1.alice" in barred and "bob" not in barred
        assert ("gpu2.alice" in barred) is binds


def test_a_ban_elsewhere_leaves_a_stage_whose_replica_is_quiet_served() -> None:
    """A stage whose replica's load reports are late is served, as placement counts it without
    bans; with a ban of another peer of the job, placement read the stages from the members
    (which leave a quiet replica out) and counted it unserved."""
    clock = FakeClock()
    registry, assignments = placement(clock, TIMEOUT_S)
    registry.load_silence_s = 1.0
    registry.announce(_serving("a", 0))
    clock.advance(10.0)  # its load reports stop
    assert registry.members("j", 1) == [[]]
    for banned in (set(), {"z"}):
        assignments.banned = lambda job, b=banned: b  # type: ignore[misc]
        assert set(assignments._serving("j", 1)) == {0}, banned
