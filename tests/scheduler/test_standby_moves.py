"""A spare replica of one stage moved to stand by for another (`Mover.stand_by`, issue 67): only
a peer the job loses nothing without, where it is and where it goes, on a host that holds none
of that stage's replicas."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter

from scheduler.assignments import Assignments
from scheduler.rebalance_loop import Mover
from scheduler.registry import PeerRegistry
from swarm.clock import MonotonicClock
from swarm.job.config import RebalanceConfig
from swarm.proto import control_pb2 as cpb
from tests.support.announcements import serving
from tests.support.fakes import SilentBus


def _serving(
    peer: str, stage: int, host: str, stages: int, router: str = ""
) -> cpb.PeerAnnouncement:
    """`serving`, on host `host`, behind `router` (its public address; "": none)."""
    announced = serving(peer, stage, speeds=[10.0] * stages)
    announced.public_address, announced.host_id = router, host
    return announced


def _mover(
    placed: list[tuple[str, int, str]],
    stages: int,
    standbys: set[str],
    short: list[int],
    routers: dict[str, str] | None = None,
    rebalancing: bool = True,
) -> tuple[Mover, Assignments, Counter]:
    registry = PeerRegistry(MonotonicClock(), load_silence_s=60.0, serve_timeout_s=60.0)
    for peer, stage, host in placed:
        registry.announce(_serving(peer, stage, host, stages, (routers or {}).get(peer, "")))

    async def say(job: str, text: str) -> None:
        pass

    assignments = Assignments(
        registry, SilentBus(), say, grace_s=0.0, serve_timeout_s=60.0, lost_stage_grace_s=0.0
    )
    moves = Counter("moves", "moves", ["job"], registry=CollectorRegistry())
    mover = Mover(
        "j",
        stages,
        RebalanceConfig(enabled=rebalancing),
        assignments,
        moves,
        standbys=lambda: standbys,
        short=lambda: short,
    )
    return mover, assignments, moves


# (peer, stage, host): stage 0 has a spare beyond its standby e; stage 1's two peers share h3
SPARE_ON_STAGE_0 = [
    ("a", 0, "h1"),
    ("b", 0, "h2"),
    ("e", 0, "h5"),
    ("c", 1, "h3"),
    ("d", 1, "h3"),
    ("f", 2, "h6"),
]


def test_a_spare_of_another_stage_moves_to_stand_by_where_none_of_its_own_may() -> None:
    # Stage 2 (10 samples/s) is the bottleneck. Stage 1's two peers share host h3: neither may
    # stand by for the other. Stage 0 has a spare beyond its standby e: a (h1) moves to stage 1,
    # where the job still loses nothing without it.
    mover, assignments, moves = _mover(SPARE_ON_STAGE_0, 3, {"e"}, [1])
    asyncio.run(mover.stand_by(0.0))
    assert assignments.on_the_way("j", 3) == [[], ["a"], []]
    assert moves.labels(job="j")._value.get() == 1.0
    asyncio.run(mover.stand_by(1.0))  # a moved just now: it stays put, and no other is sent
    assert moves.labels(job="j")._value.get() == 1.0


def test_with_rebalancing_off_no_replica_moves_to_stand_by() -> None:
    # `[rebalance] enabled = false` forbids moving replicas between stages: a standby's move is
    # one (it drains, its work is replayed, it copies the new stage), as an emptied stage's
    # refill is. The stage's own spares and joiners still stand by (the coordinator's choice).
    mover, assignments, moves = _mover(SPARE_ON_STAGE_0, 3, {"e"}, [1], rebalancing=False)
    asyncio.run(mover.stand_by(0.0))
    assert assignments.on_the_way("j", 3) == [[], [], []]
    assert moves.labels(job="j")._value.get() == 0.0


def test_a_spare_behind_another_router_than_the_stages_replicas_goes_first() -> None:
    # As above, but a shares home1's router with stage 1's replicas: b, behind home2, goes.
    placed = [
        ("a", 0, "h1"),
        ("b", 0, "h2"),
        ("e", 0, "h5"),
        ("g", 0, "h7"),
        ("c", 1, "h3"),
        ("d", 1, "h3"),
        ("f", 2, "h6"),
    ]
    routers = {"a": "10.0.0.1", "c": "10.0.0.1", "d": "10.0.0.1", "b": "10.0.0.2"}
    mover, assignments, _ = _mover(placed, 3, {"e"}, [1], routers)
    asyncio.run(mover.stand_by(0.0))
    assert assignments.on_the_way("j", 3) == [[], ["b"], []]


def test_a_peer_the_stage_would_need_as_a_replica_is_left_to_rebalancing() -> None:
    # Stage 1 is the bottleneck: a spare of stage 0 moved there raises the job's rate, so it
    # would serve, not stand by (rebalancing's move to make); none is moved for a standby.
    placed = [("a", 0, "h1"), ("b", 0, "h2"), ("e", 0, "h5"), ("c", 1, "h3")]
    mover, assignments, moves = _mover(placed, 2, {"e"}, [1])
    asyncio.run(mover.stand_by(0.0))
    assert assignments.on_the_way("j", 2) == [[], []]
    assert moves.labels(job="j")._value.get() == 0.0


def test_no_stage_short_moves_nothing() -> None:
    placed = [("a", 0, "h1"), ("b", 0, "h2"), ("c", 1, "h3")]
    mover, assignments, _ = _mover(placed, 2, set(), [])
    asyncio.run(mover.stand_by(0.0))
    assert assignments.on_the_way("j", 2) == [[], []]
