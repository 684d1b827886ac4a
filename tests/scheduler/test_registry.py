"""The peer registry alone, on a `FakeClock`: members from announcements, silence, peers that leave,
who is available to place, and the measured view rebalancing decides on; and the assignments it
leads to for peers joining a running job."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator

import pytest

from client.live import status_lines
from scheduler.assignments import Assignments, Say
from scheduler.dial_findings import was_reached
from scheduler.registry import PeerRegistry
from scheduler.replica_status import replica_status
from scheduler.stalls import Health
from swarm.bus.topics import Topics
from swarm.clock import FakeClock
from swarm.policy.placement import place_new
from swarm.policy.speeds import MAX_SAMPLES_PER_SECOND
from swarm.proto import control_pb2 as cpb
from swarm.proto import scheduler_pb2 as spb
from swarm.rpc.lease import Replica
from tests.support.announcements import serving

SILENCE_S = 10.0
SERVE_TIMEOUT_S = 300.0


def registry(clock: FakeClock) -> PeerRegistry:
    return PeerRegistry(clock, load_silence_s=SILENCE_S, serve_timeout_s=SERVE_TIMEOUT_S)


def joining(
    peer: str, job: str = "j", speeds: tuple[float, ...] = (2.0, 3.0)
) -> cpb.PeerAnnouncement:
    return cpb.PeerAnnouncement(
        peer=peer, job=job, state=cpb.PEER_STATE_JOINING, samples_per_second=dict(enumerate(speeds))
    )


def load(peer: str, stage: int, job: str = "j", seconds: float = 0.0) -> cpb.LoadReport:
    return cpb.LoadReport(peer=peer, job=job, stage=stage, ema_seconds_per_sample=seconds)


def names(members: list[list[Replica]]) -> list[list[str]]:
    return [[r.peer for r in stage] for stage in members]


def test_members_per_stage_in_peer_order() -> None:
    reg = registry(FakeClock())
    fast = serving("a", 0, speeds=(9.0, 9.0))
    for message in (serving("b", 0), fast, serving("c", 1), serving("x", 0, job="k")):
        reg.announce(message)
    reg.announce(joining("d"))
    assert names(reg.members("j", 2)) == [["a", "b"], ["c"]]
    assert reg.members("j", 2)[1] == [Replica("c", "c:1", 3.0)]  # announced speed on its stage
    assert reg.serving("j") == {0: "a:1", 1: "c:1"}  # the fastest replica of each stage
    assert names(reg.members("k", 2)) == [["x"], []]


def test_a_silent_peer_is_left_out_until_it_reports_again() -> None:
    clock = FakeClock()
    reg = registry(clock)
    reg.announce(serving("a", 0))
    reg.announce(serving("b", 1))
    reg.report_load(load("a", 0))
    reg.report_load(load("b", 1))
    clock.advance(SILENCE_S / 2)
    reg.report_load(load("b", 1))
    clock.advance(SILENCE_S / 2 + 1.0)  # a: quiet for longer than the silence, b: not
    assert names(reg.members("j", 2)) == [[], ["b"]]
    assert names(reg.members("j", 2)) == [[], ["b"]]  # stays out (logged once)
    reg.report_load(load("a", 0))
    assert names(reg.members("j", 2)) == [["a"], ["b"]]


def test_a_serving_peer_that_never_reports_is_silent_from_when_it_began_serving() -> None:
    # A peer that hangs before its first load report (SIGSTOPped a second after it began
    # serving) must be left out as one that stops reporting is, not only when a commit's call
    # to it times out (minutes).
    clock = FakeClock()
    reg = registry(clock)
    reg.announce(serving("a", 0))
    clock.advance(SILENCE_S / 2)
    reg.announce(serving("a", 0))  # announced again: still serving since the first
    reg.announce(serving("b", 1))  # new: its grace starts now
    clock.advance(SILENCE_S / 2 + 1.0)
    assert names(reg.members("j", 2)) == [[], ["b"]]
    reg.report_load(load("a", 0))
    assert names(reg.members("j", 2)) == [["a"], ["b"]]
    clock.advance(SILENCE_S)
    reg.report_load(load("a", 0))
    assert names(reg.members("j", 2)) == [["a"], []]


def test_reports_for_another_job_do_not_count() -> None:
    clock = FakeClock()
    reg = registry(clock)
    reg.announce(serving("a", 0))
    reg.report_load(load("a", 0, job="old"))
    clock.advance(SILENCE_S / 2)
    assert names(reg.members("j", 1)) == [["a"]]  # within its grace as a new member of j
    clock.advance(SILENCE_S)
    assert names(reg.members("j", 1)) == [[]]  # serving j, and no report for j: silent
    reg.report_load(load("a", 0))
    assert names(reg.members("j", 1)) == [["a"]]


def test_a_peer_serving_another_job_starts_its_grace_anew() -> None:
    clock = FakeClock()
    reg = registry(clock)
    reg.announce(serving("a", 0, job="old"))
    clock.advance(2 * SILENCE_S)
    reg.announce(serving("a", 0))  # now serving j
    assert names(reg.members("j", 1)) == [["a"]]


def test_a_peer_that_leaves_is_forgotten() -> None:
    clock = FakeClock()
    reg = registry(clock)
    reg.announce(serving("a", 0))
    reg.report_load(load("a", 0, seconds=0.5))
    reg.announce(joining("n", speeds=(math.nan, 1.0)))
    assert reg.available("j", 2) == {}  # warned about once
    reg.assigned("a", "j")
    for peer in ("a", "n"):
        reg.announce(cpb.PeerAnnouncement(peer=peer, state=cpb.PEER_STATE_OFFLINE))
    assert reg.peers == {} and names(reg.members("j", 2)) == [[], []]
    # Nothing is kept about a peer that is gone, nor about reports from peers never announced.
    reg.report_load(load("a", 0))
    reg.report_load(load("ghost", 0))
    assert reg._loads == {} and reg._assigned_at == {} and reg._unplaceable == set()


def test_peers_with_unusable_speeds_are_not_placed() -> None:
    reg = registry(FakeClock())
    for peer, speeds in {
        "good": [1.0, 2.0],
        "nan": [math.nan, 1.0],
        "negative": [-1.0, 1.0],
        "idle": [0.0, 0.0],
        "inf": [math.inf, 1.0],
        "half": [0.0, 3.0],
    }.items():
        reg.announce(
            cpb.PeerAnnouncement(
                peer=peer,
                state=cpb.PEER_STATE_JOINING,
                job="j",
                samples_per_second=dict(enumerate(speeds)),
            )
        )
    assert reg.available("j", 2) == {"good": [1.0, 2.0], "half": [0.0, 3.0]}


def test_an_assigned_peer_is_not_available_while_it_builds_its_stage() -> None:
    clock = FakeClock()
    reg = registry(clock)
    reg.announce(joining("a"))
    reg.announce(joining("b", speeds=(1.0,)))  # not measured on every stage
    reg.announce(joining("c", job="k"))
    assert reg.available("j", 2) == {"a": [2.0, 3.0]}
    reg.assigned("a", "j")
    assert reg.available("j", 2) == {}
    clock.advance(SERVE_TIMEOUT_S)  # it never came up: place it again
    assert reg.available("j", 2) == {"a": [2.0, 3.0]}
    reg.assigned("a", "j")
    reg.announce(serving("a", 1))
    reg.announce(joining("a"))  # serving cleared the assignment: joining again, it is available
    assert reg.available("j", 2) == {"a": [2.0, 3.0]}


def test_measured_waits_for_every_member_and_uses_the_live_speed() -> None:
    reg = registry(FakeClock())
    reg.announce(serving("a", 0, speeds=(2.0, 3.0)))
    reg.announce(serving("b", 1, speeds=(4.0, 5.0)))
    assert reg.measured("j", 2) is None
    reg.report_load(load("a", 0, seconds=0.25))
    assert reg.measured("j", 2) is None  # b has not measured yet
    reg.report_load(load("b", 1, seconds=0.0))  # a report without a figure
    assert reg.measured("j", 2) is None
    reg.report_load(load("b", 1, seconds=0.1))
    reg.report_load(load("b", 1, seconds=0.0))  # keeps the last figure
    assignment, speeds = reg.measured("j", 2) or ({}, {})
    assert assignment == {"a": 0, "b": 1}
    assert speeds == {"a": [4.0, 3.0], "b": [4.0, 10.0]}
    reg.announce(serving("b", 0, speeds=(4.0, 5.0)))  # moved: its figure is for the old stage
    assert reg.measured("j", 2) is None


def test_measured_leaves_out_standbys_which_measure_no_work() -> None:
    # A standby (issue 67) serves nothing, so it never reports a speed: counted, it would keep
    # rebalancing from ever deciding, and it is no replica to move or to keep a stage's floor.
    reg = registry(FakeClock())
    reg.announce(serving("a", 0, speeds=(2.0, 3.0)))
    reg.announce(serving("s", 0, speeds=(2.0, 3.0)))
    reg.report_load(load("a", 0, seconds=0.25))
    assert reg.measured("j", 1) is None
    assert reg.measured("j", 1, leave_out={"s"}) == ({"a": 0}, {"a": [4.0]})


class _RecordingBus:
    """Collects what is published (the assignments), for `Assignments` without a broker."""

    def __init__(self) -> None:
        self.topics = Topics()
        self.published: dict[str, cpb.Assignment] = {}

    async def publish(self, topic: str, message: object, retain: bool = False) -> None:
        assert isinstance(message, cpb.Assignment) and retain
        self.published[message.peer] = message


def _assignments(
    reg: PeerRegistry, bus: _RecordingBus, say: Say, grace_s: float = 0.0
) -> Assignments:
    """Placement at once (no grace periods, unless `grace_s`), publishing to `bus`."""
    return Assignments(
        reg,
        bus,  # type: ignore[arg-type]
        say,
        grace_s=grace_s,
        serve_timeout_s=SERVE_TIMEOUT_S,
        lost_stage_grace_s=0.0,
    )


async def test_peers_joining_a_running_job_are_placed_fastest_first() -> None:
    """The registry's available peers go where `placement.place_new` says, and are not
    available again while they build their stage."""
    reg = registry(FakeClock())
    reg.announce(serving("s0", 0, speeds=(5.0, 5.0)))
    reg.announce(serving("s1", 1, speeds=(3.0, 3.0)))
    reg.announce(joining("a", speeds=(1.0, 1.0)))
    reg.announce(joining("b", speeds=(4.0, 4.0)))
    bus = _RecordingBus()
    said: list[str] = []

    async def say(job_id: str, message: str) -> None:
        said.append(message)

    assignments = _assignments(reg, bus, say)
    assigned: list[str] = []
    grow = asyncio.create_task(assignments.grow("j", 2, assigned))
    await asyncio.sleep(0)  # it waits for a change now
    assignments.changed.set()
    async with asyncio.timeout(10.0):
        while len(bus.published) < 2:
            await asyncio.sleep(0.01)
    grow.cancel()
    assert {p: m.stage for p, m in bus.published.items()} == {"a": 0, "b": 1}
    assert sorted(assigned) == ["a", "b"] and said == [
        "starting 2 stage server(s): a on stage 0, b on stage 1"
    ]
    assert reg.available("j", 2) == {}


async def test_grow_ends_when_cancelled_as_an_announcement_wakes_it() -> None:
    """A job's end cancels `grow` (its trainer's task group waits for it). Python 3.11's
    `asyncio.wait_for` returned the wait's result instead of raising when the cancellation came
    after the announcement had woken the wait but before `wait_for` saw it, so `grow` looped on
    and the job never ended (a test's teardown hung one run in 20)."""
    reg = registry(FakeClock())
    said: list[str] = []

    async def say(job_id: str, message: str) -> None:
        said.append(message)

    assignments = _assignments(reg, _RecordingBus(), say)
    grow = asyncio.create_task(assignments.grow("j", 2, []))
    await asyncio.sleep(0)  # it waits for a change now
    assignments.changed.set()  # an announcement wakes the wait ...
    await asyncio.sleep(0)  # ... which finishes, its waker not yet run ...
    grow.cancel()  # ... when the job ends
    done, _ = await asyncio.wait([grow], timeout=1.0)
    assert grow in done and grow.cancelled()


@contextlib.asynccontextmanager
async def _placing(reg: PeerRegistry, stages: int, health: Health) -> AsyncIterator[list[str]]:
    """Placement of job "j" of `stages` stages under way: what it said, once it said something;
    it is cancelled on the way out."""
    said: list[str] = []

    async def say(job_id: str, message: str) -> None:
        said.append(message)

    assignments = Assignments(
        reg,
        _RecordingBus(),  # type: ignore[arg-type]
        say,
        grace_s=0.0,
        serve_timeout_s=SERVE_TIMEOUT_S,
        lost_stage_grace_s=30.0,
        health=lambda _: health,
    )
    place = asyncio.create_task(assignments.place("j", stages, lambda: 0, []))
    try:
        async with asyncio.timeout(10.0):
            while not said:
                await asyncio.sleep(0.01)
        yield said
    finally:
        place.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await place


async def test_placement_says_how_many_peers_a_job_needs_and_since_when_it_waits() -> None:
    reg = registry(FakeClock())
    reg.announce(joining("a", speeds=(1.0, 1.0, 1.0, 1.0)))
    health = Health()
    async with _placing(reg, 4, health) as said:
        assert said[0] == (
            "waiting for peers: stages 0, 1, 2, 3 without a replica; this job's 4 stage(s) need "
            "at least 4 stage server(s), one per stage (0 served, 1 more peer(s) measured): start "
            "a stage server for this job (`swarm stage-server --broker URL`, as for the others) "
            "(3 more)"
        )
        assert health.waiting_since > 0  # `swarm status` counts how long
    assert health.waiting_since == 0.0


async def test_a_job_waiting_for_peers_names_those_that_refused_it_and_why() -> None:
    """A peer that could not measure the job (or fetch its checkpoint, or build its stage)
    announces itself free, its speeds gone: the job said it waited "for peers ... start a stage
    server", while a server was there and had said why only in its own log."""
    reg = registry(FakeClock())
    refusing = cpb.PeerAnnouncement(
        peer="gpu-1",
        address="gpu-1:5000",
        state=cpb.PEER_STATE_JOINING,
        refused_job="j",
        refused="building stage 1 failed (OutOfDeviceMemory: out of device memory)",
    )
    reg.announce(refusing)
    for i in range(10):  # any token holder's peers may say so: a few are named, the rest counted
        said_too = cpb.PeerAnnouncement()
        said_too.CopyFrom(refusing)
        said_too.peer, said_too.refused = f"z{i}", "forged\nERROR scheduler: a line"
        if i == 0:  # words that would pass for the scheduler's own, out of their quotes
            said_too.refused = 'x"; left out after 3 assignments: gpu-1 (stage 0'
        reg.announce(said_too)
    reg.announce(joining("p"))
    async with _placing(reg, 4, Health()) as said:
        assert said[0].startswith("waiting for peers: "), said
    assert said[0].endswith(
        '; refused by gpu-1: "building stage 1 failed (OutOfDeviceMemory: out of device memory)"; '
        'z0: "x\\"; left out after 3 assignments: gpu-1 (stage 0"; '
        'z1: "forged\\nERROR scheduler: a line" (and 8 more)'
    ), said


async def test_a_peer_measured_while_placement_speaks_is_placed_at_once() -> None:
    """An announcement that lands after placement read the registry but before it waits (here,
    while it publishes what it waits for) wakes it: it used to clear the wake-up and sleep its
    whole 5 s wait, in every job's start."""
    reg = registry(FakeClock())
    bus = _RecordingBus()
    assignments: Assignments

    async def say(job_id: str, message: str) -> None:
        if message.startswith("waiting for peers"):  # the peers measure meanwhile
            reg.announce(joining("a", speeds=(1.0, 1.0)))
            reg.announce(joining("b", speeds=(1.0, 1.0)))
            assignments.changed.set()  # as the bus feeder does after each announcement

    assignments = _assignments(reg, bus, say)
    place = asyncio.create_task(assignments.place("j", 2, lambda: 0, []))
    await _placed(place, bus, 2, timeout_s=2.0)  # well under the 5 s a lost wake-up costs
    assert sorted(bus.published) == ["a", "b"]


async def _placed(place: asyncio.Task[None], bus: _RecordingBus, n: int, timeout_s: float) -> None:
    """Once `n` assignments are published (within `timeout_s`), `place` cancelled."""
    try:
        async with asyncio.timeout(timeout_s):
            while len(bus.published) < n:
                await asyncio.sleep(0.01)
    finally:
        place.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await place


async def test_the_placement_grace_ends_once_no_free_peer_is_still_measuring() -> None:
    """The grace before a placement waits for the peers still measuring the job, not for its
    length: while a free peer has announced no figures, nothing is placed; once it has, all
    three are placed at once, an hour's grace notwithstanding (a fixed 2 s grace delayed every
    job's start with every peer measured)."""
    reg = registry(FakeClock())
    reg.announce(joining("a", speeds=(1.0, 1.0)))
    reg.announce(joining("b", speeds=(1.0, 1.0)))
    reg.announce(cpb.PeerAnnouncement(peer="c", state=cpb.PEER_STATE_JOINING))  # measuring
    bus = _RecordingBus()

    async def say(job_id: str, message: str) -> None:
        pass

    assignments = _assignments(reg, bus, say, grace_s=3600.0)
    place = asyncio.create_task(assignments.place("j", 2, lambda: 0, []))
    for _ in range(20):  # placement runs up to its grace
        await asyncio.sleep(0)
    assert bus.published == {}  # c may still be measuring: it is waited for
    reg.announce(joining("c", speeds=(2.0, 2.0)))
    assignments.changed.set()  # as the bus feeder does after each announcement
    await _placed(place, bus, 3, timeout_s=10.0)  # not the hour
    assert sorted(bus.published) == ["a", "b", "c"]


def test_shown_counts_a_peer_serving_only_once_admitted_and_says_what_the_rest_wait_for() -> None:
    clock = FakeClock()
    reg = registry(clock)
    for message in (serving("a", 0), serving("b", 0), joining("c"), joining("d")):
        reg.announce(message)
    reg.assigned("c", "j", 1)  # building stage 1; d is measured, not placed
    clock.advance(3.0)

    def rows(admitted: set[str] | None) -> list[tuple[str, int, int, str]]:
        shown = reg.shown("j", admitted, {"b": "downloading state from a"})
        return [(s.announcement.peer, s.stage, s.state, s.joining) for s in shown]

    j, s = cpb.PEER_STATE_JOINING, cpb.PEER_STATE_SERVING
    assert rows({"a"}) == [
        ("a", 0, s, ""),
        ("b", 0, j, "downloading state from a"),
        ("c", 1, j, "building stage 1 (assigned 3 s ago)"),
    ]
    assert rows(None)[0] == ("a", 0, j, "waiting for training to start")  # no coordinator
    # The stage given stays known when the peer leaves: it comes back to it (issue 45, item 5).
    reg.announce(cpb.PeerAnnouncement(peer="c", state=cpb.PEER_STATE_OFFLINE))
    assert reg.given("j", "c") == 1 and reg.given("k", "c") is None
    reg.withdrawn("j")
    assert reg.given("j", "c") is None


def test_shown_names_the_coordinators_standbys_standby_with_their_words() -> None:
    # Issue 67: a standby serves its stage's announcement but is no member; status shows it as
    # STANDBY (not joining), with the coordinator's words (its lag in steps).
    reg = registry(FakeClock())
    for message in (serving("a", 0), serving("b", 0)):
        reg.announce(message)
    words = {"b": "standby for stage 0, 0 steps behind (following a)"}
    shown = reg.shown("j", {"a"}, words, standbys={"b"})
    assert [(s.announcement.peer, s.state, s.joining) for s in shown] == [
        ("a", cpb.PEER_STATE_SERVING, ""),
        ("b", cpb.PEER_STATE_STANDBY, words["b"]),
    ]


def test_status_shows_a_replicas_live_speed_not_the_one_it_measured_at_join() -> None:
    """Issue 51: samples/s in `swarm status` stayed at the join-time figure while the peer slowed
    down (another program on its GPU) or sped up; it follows the load reports now."""
    reg = registry(FakeClock())
    reg.announce(serving("a", 1, speeds=(2.0, 3.0)))

    def speed() -> float:
        (shown,) = reg.shown("j", {"a"})
        return replica_status(shown, reg).samples_per_second

    assert speed() == 3.0  # no report yet: what it measured at join
    reg.report_load(load("a", 1, seconds=0.1))
    assert speed() == 10.0
    reg.report_load(load("a", 1, seconds=0.5))  # slowed down
    assert speed() == 2.0
    reg.report_load(load("a", 1))  # a report without a figure keeps the last one
    assert speed() == 2.0
    reg.report_load(load("a", 0, seconds=0.01))  # about another stage: not this one's speed
    assert speed() == 3.0


def test_status_shows_what_a_replica_sent_across_its_boundaries() -> None:
    """Issue 52: a replica's load reports carry its boundary traffic; status shows the last one
    about the stage it serves, none about another (job, stage)."""
    reg = registry(FakeClock())
    reg.announce(serving("a", 1))

    def boundary() -> cpb.BoundaryTraffic:
        (shown,) = reg.shown("j", {"a"})
        return replica_status(shown, reg).boundary

    assert boundary() == cpb.BoundaryTraffic()  # no report yet
    traffic = cpb.BoundaryTraffic(
        forward_bytes=4096, forward_tokens=32, backward_bytes=2048, backward_tokens=16
    )
    report = load("a", 1)
    report.boundary.CopyFrom(traffic)
    reg.report_load(report)
    assert boundary() == traffic
    other = load("a", 0)
    other.boundary.CopyFrom(traffic)
    reg.report_load(other)  # about another stage: not this one's traffic
    assert boundary() == cpb.BoundaryTraffic()


def test_status_says_since_when_a_serving_replica_has_been_silent() -> None:
    """Issue 68 item 3: for 17 s after a home's router was pulled, status showed its peers as
    `serving`. Three missed load reports on, it says since when each has been silent."""
    clock = FakeClock()
    reg = registry(clock)
    reg.announce(serving("a", 1))
    reg.report_load(load("a", 1, seconds=0.1))

    def replica() -> spb.Replica:
        (shown,) = reg.shown("j", {"a"})
        return replica_status(shown, reg, wall=lambda: 1_000_000.0 + clock.now())

    assert replica().silent_since == 0.0  # it reports
    clock.advance(2.0)
    assert replica().silent_since == 0.0  # a report or two late: not yet said
    clock.advance(3.0)
    r = replica()
    assert r.silent_since == 1_000_000.0  # its last report's time of day
    status = spb.JobStatus(job="j", stages=[spb.StageStatus(stage=1, replicas=[r])])
    at = time.strftime("%H:%M:%S", time.localtime(r.silent_since))
    assert f"serving, silent since {at} (5 s)" in "\n".join(status_lines(status, now=1_000_005.0))
    reg.report_load(load("a", 1, seconds=0.1))
    assert replica().silent_since == 0.0  # back


@pytest.mark.attack("64-speeds")
@pytest.mark.parametrize("bad", [1e308, math.inf, math.nan, -1.0, 2e6])
def test_announced_speeds_are_taken_within_a_ceiling(bad: float) -> None:
    """Issue 64, item 2: two peers announcing ~1e308 samples/s made placement's prices divide by
    zero outside the job loop's retry (the job FAILED within 2 s). Each speed is taken within
    `MAX_SAMPLES_PER_SECOND` where it enters; one not finite or negative leaves its peer out."""
    reg = registry(FakeClock())
    for peer in ("liar1", "liar2"):
        reg.announce(joining(peer, speeds=(bad, bad)))
    reg.announce(joining("honest", speeds=(5.0, 5.0)))
    available = reg.available("j", 2)
    assert all(0.0 <= v <= MAX_SAMPLES_PER_SECOND for row in available.values() for v in row)
    assert available["honest"] == [5.0, 5.0]
    if math.isfinite(bad) and bad > 0:  # taken at the ceiling
        assert available["liar1"] == [MAX_SAMPLES_PER_SECOND] * 2
    else:  # it can serve no stage: not placed
        assert set(available) == {"honest"}
    placed = place_new(available, 2)  # it raised ZeroDivisionError at 1e308
    assert set(placed.values()) == ({0, 1} if len(available) > 1 else {0})


@pytest.mark.attack("64-speeds")
def test_where_the_swarm_measured_a_peer_its_measure_stands() -> None:
    """A peer that served stage 0 at 4 samples/s (its load reports) and announces 1e6 there is
    placed at 4."""
    reg = registry(FakeClock())
    reg.announce(joining("a", speeds=(1e6, 3.0)))
    reg.report_load(load("a", 0, seconds=0.25))
    assert reg.available("j", 2)["a"] == [4.0, 3.0]


@pytest.mark.attack("64-speeds")
async def test_two_peers_at_1e308_do_not_fail_the_job() -> None:
    """The placement loop itself (`Assignments.place`) with two liars and one honest peer: the
    stages are given (before: the loop raised, and the job was FAILED)."""
    reg = registry(FakeClock())
    for peer in ("liar1", "liar2"):
        reg.announce(joining(peer, speeds=(1e308, 1e308)))
    reg.announce(joining("honest", speeds=(5.0, 5.0)))
    bus = _RecordingBus()

    async def say(job_id: str, message: str) -> None:
        pass

    assignments = _assignments(reg, bus, say)
    place = asyncio.create_task(assignments.place("j", 2, lambda: 0, []))
    try:
        async with asyncio.timeout(10.0):
            while len(bus.published) < 2 and not place.done():
                await asyncio.sleep(0.01)
        assert not place.done(), place.exception()  # it waits for them to serve
        assert {m.stage for m in bus.published.values()} == {0, 1}
    finally:
        place.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await place


@pytest.mark.attack("64-seats")
async def test_a_host_holds_one_seat_of_a_stage() -> None:
    """Issue 64, item 4: two ids of one token holder announcing speed for stage 1 alone both
    landed there (the failure domains that spread them are their own word), to outvote its
    third replica in the audits. A host (where the dial-back reaches it) holds one seat of a
    stage: the second id waits."""
    reg = registry(FakeClock())
    reg.announce(serving("s0", 0, speeds=(5.0, 5.0)))
    reg.announce(serving("s1", 1, speeds=(5.0, 5.0)))
    for name, port in (("sybil1", 7000), ("sybil2", 7001)):
        message = joining(name, speeds=(0.0, 9.0))
        message.address = f"5.6.7.8:{port}"
        reg.announce(message)
    bus = _RecordingBus()

    async def say(job_id: str, message: str) -> None:
        pass

    assignments = _assignments(reg, bus, say)
    grow = asyncio.create_task(assignments.grow("j", 2, []))
    await asyncio.sleep(0)
    assignments.changed.set()
    try:
        async with asyncio.timeout(10.0):
            while not bus.published:
                await asyncio.sleep(0.01)
    finally:
        grow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await grow
    assert [(m.peer, m.stage) for m in bus.published.values()] == [("sybil1", 1)]
    # the ids held back are kept (to be said once) while they are known, not for good
    reg.announce(cpb.PeerAnnouncement(peer="sybil2", state=cpb.PEER_STATE_OFFLINE))
    late = joining("sybil3", speeds=(0.0, 9.0))
    late.address = "5.6.7.8:7002"
    reg.announce(late)
    grow = asyncio.create_task(assignments.grow("j", 2, []))
    await asyncio.sleep(0)
    assignments.changed.set()
    try:
        async with asyncio.timeout(10.0):
            while "sybil3" not in assignments._held_back:
                await asyncio.sleep(0.01)
    finally:
        grow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await grow
    assert assignments._held_back == {"sybil3"}


def test_a_peer_was_reached_at_the_address_it_announces_now_only() -> None:
    """/sd lists a peer the dial-back reached (`scheduler.discovery`): a report of the address
    it announced before kept it listed, for the dial-back's misses before it demotes one, at
    whatever internal host it announced since."""
    reg = registry(FakeClock())
    reg.announce(cpb.PeerAnnouncement(peer="p", address="203.0.113.7:7000"))
    assert not was_reached(reg, "p")  # not dialled yet
    direct = cpb.REACHABILITY_DIRECT
    reg.reached(cpb.ReachabilityReport(peer="p", reachability=direct, address="203.0.113.7:7000"))
    assert was_reached(reg, "p")
    reg.announce(cpb.PeerAnnouncement(peer="p", address="10.1.2.3:7000"))
    assert not was_reached(reg, "p")
    reg.reached(cpb.ReachabilityReport(peer="p", reachability=direct, address="10.1.2.3:7000"))
    assert was_reached(reg, "p")  # the dial-back reached it there (--dial-private)
