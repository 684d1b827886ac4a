"""What the registry makes of each peer's dial-back (`PeerRegistry.reached`), and what placement
does with it: an unreachable peer is no member and never placed (the job's message says why,
with the remedy), a relayed one is dialled through its relay and placed at its path's price."""

from __future__ import annotations

import asyncio
import contextlib
import math

import pytest

from scheduler.assignments import Assignments
from scheduler.registry import UNREACHABLE_SHOWN, PeerRegistry
from scheduler.replica_status import unreachable_warnings
from scheduler.store import JobRecord
from swarm.bus.topics import Topics
from swarm.clock import FakeClock
from swarm.net import paths
from swarm.proto import control_pb2 as cpb

SERVE_TIMEOUT_S = 300.0


def registry(require_reachable: bool = True) -> PeerRegistry:
    return PeerRegistry(
        FakeClock(),
        load_silence_s=10.0,
        serve_timeout_s=SERVE_TIMEOUT_S,
        require_reachable=require_reachable,
    )


def peer(
    name: str,
    state: int = cpb.PEER_STATE_JOINING,
    stage: int | None = None,
    speeds: tuple[float, ...] = (2.0, 2.0),
    relay: str = "",
) -> cpb.PeerAnnouncement:
    message = cpb.PeerAnnouncement(
        peer=name,
        address=f"{name}.lan:5000",
        job="j",
        state=state,  # type: ignore[arg-type]
        samples_per_second=dict(enumerate(speeds)),
        relay=relay,
    )
    if stage is not None:
        message.stage = stage
    return message


def report(name: str, reachability: int, relay: str = "") -> cpb.ReachabilityReport:
    unreachable = reachability == cpb.REACHABILITY_UNREACHABLE
    return cpb.ReachabilityReport(
        peer=name,
        reachability=reachability,  # type: ignore[arg-type]
        address=f"{name}.lan:5000",
        relay=relay,
        detail="UNAVAILABLE: Connection refused" if unreachable else "",
        remedy="give it --announce-host, forward its port, or start a relay" if unreachable else "",
    )


def test_an_unreachable_peer_is_no_member_serves_nothing_and_is_not_placed() -> None:
    reg = registry()
    reg.announce(peer("a", cpb.PEER_STATE_SERVING, stage=0))
    reg.announce(peer("b", cpb.PEER_STATE_SERVING, stage=1))
    reg.announce(peer("c"))
    for name in "abc":
        reg.reached(report(name, cpb.REACHABILITY_DIRECT if name == "a" else 3))
    assert [[r.peer for r in s] for s in reg.members("j", 2)] == [["a"], []]
    assert reg.serving("j") == {0: "a.lan:5000"}
    assert reg.available("j", 2) == {}
    assert [r.peer for r in reg.unreachable("j")] == ["b", "c"]
    reg.reached(report("c", cpb.REACHABILITY_DIRECT))  # its router forwards the port now
    assert reg.available("j", 2) == {"c": [2.0, 2.0]}


def test_a_peer_not_checked_yet_is_not_placed_but_a_serving_one_still_counts() -> None:
    reg = registry()
    reg.announce(peer("a", cpb.PEER_STATE_SERVING, stage=0))  # served before a restart
    reg.announce(peer("c"))
    assert [[r.peer for r in s] for s in reg.members("j", 2)] == [["a"], []]
    assert reg.available("j", 2) == {}  # unknown: its dial-back takes two seconds
    assert registry(require_reachable=False).available("j", 2) == {}  # (none announced there)
    unchecked = registry(require_reachable=False)
    unchecked.announce(peer("c"))
    assert unchecked.available("j", 2) == {"c": [2.0, 2.0]}  # without checks: as before


def test_a_relayed_peer_is_dialled_through_its_relay() -> None:
    reg = registry()
    reg.announce(peer("n", cpb.PEER_STATE_SERVING, stage=1, relay="relay.example:7000"))
    via = paths.relayed_address("n", "n.lan:5000", "relay.example:7000")
    # Not checked yet: where it says it is reached.
    assert reg.members("j", 2)[1][0].address == via
    reg.reached(report("n", cpb.REACHABILITY_RELAYED, relay="relay.example:7000"))
    assert reg.members("j", 2)[1][0].address == via
    assert reg.serving("j") == {1: via}
    assert reg.relayed("n")
    reg.reached(report("n", cpb.REACHABILITY_DIRECT))  # reachable directly after all
    assert reg.members("j", 2)[1][0].address == "n.lan:5000" and not reg.relayed("n")


def test_a_relayed_peer_that_moved_to_another_relay_is_dialled_through_the_new_one() -> None:
    """Its relay died and it re-attached elsewhere (issue 42, a relay killed mid-step): from its
    announcement on, calls go through the relay it names, not the dead one its last dial-back
    found, in the moment before that is checked again."""
    reg = registry()
    reg.announce(peer("n", cpb.PEER_STATE_SERVING, stage=1, relay="a.example:7100"))
    reg.reached(report("n", cpb.REACHABILITY_RELAYED, relay="a.example:7100"))
    reg.announce(peer("n", cpb.PEER_STATE_SERVING, stage=1, relay="b.example:7100"))
    via_b = paths.relayed_address("n", "n.lan:5000", "b.example:7100")
    assert reg.members("j", 2)[1][0].address == via_b
    # Announced without one (between relays, none answering): the last one found still stands.
    reg.announce(peer("n", cpb.PEER_STATE_SERVING, stage=1))
    via_a = paths.relayed_address("n", "n.lan:5000", "a.example:7100")
    assert reg.members("j", 2)[1][0].address == via_a


def test_rebalancing_sees_a_relayed_member_at_its_paths_price() -> None:
    reg = registry()
    reg.announce(peer("a", cpb.PEER_STATE_SERVING, stage=0, speeds=(4.0, 4.0)))
    reg.announce(peer("n", cpb.PEER_STATE_SERVING, stage=1, speeds=(4.0, 4.0), relay="r:7"))
    reg.reached(report("a", cpb.REACHABILITY_DIRECT))
    reg.reached(report("n", cpb.REACHABILITY_RELAYED, "r:7"))
    for name, stage in (("a", 0), ("n", 1)):
        reg.report_load(cpb.LoadReport(peer=name, job="j", stage=stage, ema_seconds_per_sample=0.1))
    measured = reg.measured("j", 2)
    assert measured is not None
    assert measured[1] == {"a": [10.0, 4.0], "n": [2.0, 5.0]}  # n: 10/s, 5 via its relay


def test_a_peer_that_leaves_takes_its_report_along() -> None:
    reg = registry()
    reg.announce(peer("c"))
    reg.reached(report("c", cpb.REACHABILITY_DIRECT))
    reg.announce(cpb.PeerAnnouncement(peer="c", state=cpb.PEER_STATE_OFFLINE))
    assert reg.reachability("c") is None
    reg.reached(report("c", cpb.REACHABILITY_DIRECT))  # a late check of a gone peer: ignored
    assert reg.reachability("c") is None


class _Bus:
    def __init__(self) -> None:
        self.topics = Topics()
        self.published: dict[str, cpb.Assignment] = {}

    async def publish(self, topic: str, message: object, retain: bool = False) -> None:
        assert isinstance(message, cpb.Assignment)
        self.published[message.peer] = message


def _assignments(reg: PeerRegistry, bus: _Bus, said: list[str]) -> Assignments:
    async def say(job_id: str, message: str) -> None:
        said.append(message)

    return Assignments(
        reg,
        bus,  # type: ignore[arg-type]
        say,
        grace_s=0.0,
        serve_timeout_s=SERVE_TIMEOUT_S,
        lost_stage_grace_s=0.0,
    )


async def _placing(reg: PeerRegistry) -> tuple[_Bus, list[str]]:
    """A placement of job "j" (one stage) run until it said something: what it published and
    what it said."""
    bus, said = _Bus(), list[str]()
    place = asyncio.create_task(_assignments(reg, bus, said).place("j", 1, lambda: 0, []))
    async with asyncio.timeout(10.0):
        while not said:
            await asyncio.sleep(0.01)
    place.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await place
    return bus, said


async def test_a_job_waiting_for_peers_names_those_nobody_can_dial_with_the_remedy() -> None:
    reg = registry()
    reg.announce(peer("c"))
    reg.reached(report("c", cpb.REACHABILITY_UNREACHABLE))
    bus, said = await _placing(reg)
    assert bus.published == {}  # no work down a path nobody can dial
    assert said[0].endswith(
        "; not placed, UNREACHABLE: c at c.lan:5000 (UNAVAILABLE: Connection refused): give it "
        "--announce-host, forward its port, or start a relay"
    )


async def test_placement_keeps_a_relayed_peer_off_a_stage_it_alone_would_bottleneck() -> None:
    reg = registry()
    for name, speeds in (("a", (10.0, 10.0)), ("b", (10.0, 10.0)), ("r", (12.0, 12.0))):
        reg.announce(peer(name, speeds=speeds, relay="relay:7" if name == "r" else ""))
        relayed = name == "r"
        reg.reached(
            report(name, cpb.REACHABILITY_RELAYED if relayed else 1, "relay:7" if relayed else "")
        )
    bus, said = _Bus(), list[str]()
    await _assignments(reg, bus, said)._assign_available("j", reg.available("j", 2), [], 1)
    stage = {p: m.stage for p, m in bus.published.items()}
    # Measured alone r (12) would get a stage of its own; through its relay it carries 6.
    assert sorted(p for p, k in stage.items() if k == stage["r"]) in (["a", "r"], ["b", "r"])


class _View:
    """What the collector reads of a scheduler (`scheduler.collector.SchedulerView`)."""

    def __init__(self, registry: PeerRegistry) -> None:
        # job "j", which the scheduler knows (a job only a peer names is no label: collector.py)
        record = JobRecord("j", "j", "", "/", "running", 0, 3, math.nan, "", "", 0.0, 0.0)
        self.peer_registry, self.snapshot = registry, {"j": record}

    def admitted(self, job_id: str) -> frozenset[str] | None:
        return None

    def standbys(self, job_id: str) -> frozenset[str]:
        return frozenset()


def test_each_peers_reachability_is_a_gauge() -> None:
    from prometheus_client import CollectorRegistry

    from scheduler.collector import collector

    reg = registry()
    for name in "abcd":
        reg.announce(peer(name, relay="relay:7" if name == "b" else ""))
    reg.reached(report("a", cpb.REACHABILITY_DIRECT))
    reg.reached(report("b", cpb.REACHABILITY_RELAYED, "relay:7"))
    reg.reached(report("c", cpb.REACHABILITY_UNREACHABLE))
    metrics = CollectorRegistry()
    metrics.register(collector(_View(reg)))  # type: ignore[arg-type]
    ones = {
        (s.labels["peer"], s.labels["reachability"])
        for family in metrics.collect()
        if family.name == "swarm_peer_reachability"
        for s in family.samples
        if s.value == 1.0
    }
    assert ones == {("a", "direct"), ("b", "relayed"), ("c", "unreachable"), ("d", "unknown")}


def test_bytes_per_token_per_boundary_is_a_gauge() -> None:
    """Issue 52: forward at K|K+1 from stage K's serving replicas, backward from stage K+1's,
    summed over replicas, as their load reports say."""
    from prometheus_client import CollectorRegistry

    from scheduler.collector import collector

    reg = registry(require_reachable=False)
    sent = {"a": (0, (800, 4, 0, 0)), "b": (1, (100, 1, 600, 2)), "c": (1, (300, 1, 0, 1))}
    for name, (stage, counts) in sent.items():
        reg.announce(peer(name, cpb.PEER_STATE_SERVING, stage))
        fb, ft, bb, bt = counts
        traffic = cpb.BoundaryTraffic(
            forward_bytes=fb, forward_tokens=ft, backward_bytes=bb, backward_tokens=bt
        )
        reg.report_load(cpb.LoadReport(peer=name, job="j", stage=stage, boundary=traffic))
    metrics = CollectorRegistry()
    metrics.register(collector(_View(reg)))  # type: ignore[arg-type]
    got = {
        (s.labels["job"], s.labels["boundary"], s.labels["direction"]): s.value
        for family in metrics.collect()
        if family.name == "swarm_scheduler_boundary_bytes_per_token"
        for s in family.samples
    }
    assert got == {
        ("j", "0|1", "forward"): 200.0,
        ("j", "1|2", "forward"): 200.0,
        ("j", "0|1", "backward"): 200.0,
    }


@pytest.mark.attack("unreachable-crowd")
async def test_a_crowd_of_unreachable_peers_is_counted_not_listed() -> None:
    """Any token holder may log in under many ids that nobody can dial, free for any job (each
    is in every job's list): 16,384 such peers made each waiting job's message 10.9 MB (stored,
    logged and sent with its status on every change) and each live job's status warnings 22.9
    MB. A few are named, with the remedy, and the rest counted."""
    reg = registry()
    crowd = 500
    for i in range(crowd):
        free = peer(f"u{i:04d}")
        free.job = ""  # free for any job: in every job's list
        reg.announce(free)
        reg.reached(report(f"u{i:04d}", cpb.REACHABILITY_UNREACHABLE))
    _, said = await _placing(reg)
    message = said[0]
    assert "UNREACHABLE: u0000 at u0000.lan:5000" in message
    assert f"(and {crowd - UNREACHABLE_SHOWN} more)" in message
    assert "u0499" not in message and len(message) < 2_000, len(message)
    warnings = unreachable_warnings(reg, "j")
    assert len(warnings) == UNREACHABLE_SHOWN + 1, len(warnings)
    assert warnings[0].startswith("peer u0000 is UNREACHABLE at u0000.lan:5000")
    assert warnings[-1] == f"{crowd - UNREACHABLE_SHOWN} more peers are UNREACHABLE"
    # the job's own peer is named first, whatever the crowd's ids
    reg.announce(peer("zz-own"))
    reg.reached(report("zz-own", cpb.REACHABILITY_UNREACHABLE))
    assert unreachable_warnings(reg, "j")[0].startswith("peer zz-own is UNREACHABLE")


@pytest.mark.attack("route-inf")
def test_a_members_speed_that_is_no_speed_is_unknown() -> None:
    """A serving peer's announced speed goes into every lease of its stage, and from there into
    each push's route: a NaN, infinite or negative one (`plausible_speeds` keeps them, for
    `available` to leave a joiner out) would have every route refused (`check_route`), or the
    trainer's wiring raise (infinity). A member's is its speed, or 0: unknown."""
    reg = registry(require_reachable=False)
    for name, bad in [("a", math.nan), ("b", math.inf), ("c", -1.0), ("d", 3.0)]:
        reg.announce(peer(name, cpb.PEER_STATE_SERVING, stage=1, speeds=(2.0, bad)))
    speeds = {r.peer: r.throughput for r in reg.members("j", 2)[1]}
    assert speeds == {"a": 0.0, "b": 0.0, "c": 0.0, "d": 3.0}, speeds


@pytest.mark.parametrize(
    ("name", "relay", "address"),
    [("a@b", "relay.example:7000", "h:1"), ("a", "r:1/x", "h:1"), ("a", "relay.example:7000", "")],
    ids=["@ in its id", "/ in its relay", "no address"],
)
def test_an_announcement_no_relayed_address_can_be_written_for_is_dialled_as_announced(
    name: str, relay: str, address: str
) -> None:
    """Any token holder may announce a peer whose id or relay cannot make a relayed address (or
    with no address): the registry's lookups raised ValueError, and every running job's stall
    watch reads every peer's (`domains`) each second, so every job's attempt ended, again at
    each attempt while the announcement was held. It is dialled at its address, as announced;
    its calls fail, the jobs go on."""
    reg = registry()
    announced = peer(name, state=cpb.PEER_STATE_SERVING, stage=0, relay=relay)
    announced.address = address
    reg.announce(announced)
    assert reg.domains()[name] is not None
    assert reg.members("j", 2)[0][0].address == address
    assert not reg.relayed(name) and reg.serving("j") == {0: address}
    reg.reached(cpb.ReachabilityReport(peer=name, reachability=cpb.REACHABILITY_RELAYED))
    assert reg.members("j", 2)[0][0].address == address
