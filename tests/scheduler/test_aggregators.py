"""The scheduler and aggregator peers (issue 43, item 4): the aggregators present and their rates
from the registry's announcements (`scheduler.aggregators`), and placement that never gives one a
stage, whatever it announces (`scheduler.assignments`)."""

from __future__ import annotations

import asyncio
import math

import pytest

from scheduler.aggregators import AggregatorPeer, offered, present
from scheduler.assignments import Assignments
from scheduler.registry import PeerRegistry
from swarm.bus.topics import Topics
from swarm.clock import FakeClock
from swarm.proto import control_pb2 as cpb

pytestmark = pytest.mark.timeout(30)


def _registry() -> PeerRegistry:
    return PeerRegistry(FakeClock(), load_silence_s=10.0, serve_timeout_s=300.0)


def _aggregator(
    peer: str, up: float = 0.0, down: float = 0.0, state: int = cpb.PEER_STATE_SERVING
) -> cpb.PeerAnnouncement:
    return cpb.PeerAnnouncement(
        peer=peer,
        address=f"{peer}:7000",
        state=state,  # type: ignore[arg-type]
        role=cpb.PEER_ROLE_AGGREGATOR,
        upload_bytes_per_second=up,
        download_bytes_per_second=down,
    )


def _joining(peer: str, role: int = cpb.PEER_ROLE_STAGE_SERVER) -> cpb.PeerAnnouncement:
    return cpb.PeerAnnouncement(
        peer=peer,
        address=f"{peer}:1",
        job="j",
        state=cpb.PEER_STATE_JOINING,
        role=role,  # type: ignore[arg-type]
        samples_per_second={0: 2.0, 1: 3.0},
    )


def test_the_aggregators_present_with_their_rates_in_peer_order() -> None:
    reg = _registry()
    reg.announce(_aggregator("z-agg", up=125e6, down=125e6))
    reg.announce(_aggregator("a-agg", up=12.5e6, down=0.0))  # its download rate is not known
    reg.announce(_joining("stage-peer"))
    reg.announce(_aggregator("nan-agg", up=math.nan, down=-1.0))
    relayed = _aggregator("nat-agg", up=125e6, down=125e6)
    relayed.relay = "relay.example.org:7900"
    reg.announce(relayed)  # reached through a relay: offered to no round
    offers = offered(reg.peers, lambda a: a)

    def seam() -> list[AggregatorPeer]:
        return offers(0)

    assert offers(1) == seam()  # every stage of a job is offered the same ones
    assert seam() == [
        AggregatorPeer("a-agg", "a-agg:7000", 12.5e6, 0.0),
        AggregatorPeer("nan-agg", "nan-agg:7000", 0.0, 0.0),  # rates it cannot mean: unknown
        AggregatorPeer("z-agg", "z-agg:7000", 125e6, 125e6),
    ]
    assert [a.rate for a in seam()] == [12.5e6, 0.0, 125e6]
    reg.announce(_aggregator("z-agg", state=cpb.PEER_STATE_OFFLINE))  # its will, or a stop
    assert [a.peer for a in seam()] == ["a-agg", "nan-agg"]  # read anew at every call


def test_only_the_fastest_aggregators_join_a_round() -> None:
    peers = {
        name: _aggregator(name, up=rate, down=rate)
        for name, rate in [("a", 1e6), ("b", 9e6), ("c", 0.0), ("d", 5e6)]
    }
    assert [a.peer for a in present(peers, limit=2)] == ["b", "d"]
    assert [a.peer for a in present(peers, limit=0)] == []


class _RecordingBus:
    def __init__(self) -> None:
        self.topics = Topics()
        self.published: dict[str, int] = {}

    async def publish(self, topic: str, message: object, retain: bool = False) -> None:
        assert isinstance(message, cpb.Assignment)
        self.published[message.peer] = message.stage


@pytest.mark.attack("43.4")
async def test_an_aggregator_is_never_placed_on_a_stage_whatever_it_announces() -> None:
    """An aggregator that says it is measured for a job (a bug, or a hostile one) is left out
    of placement: only stage servers get stages. (Before the filter it was given one.)"""
    reg = _registry()
    reg.announce(_joining("agg", role=cpb.PEER_ROLE_AGGREGATOR))
    reg.announce(_joining("relay", role=cpb.PEER_ROLE_RELAY))
    said: list[str] = []

    async def say(job: str, text: str) -> None:
        said.append(text)

    bus = _RecordingBus()
    assignments = Assignments(
        reg,
        bus,  # type: ignore[arg-type]
        say,
        grace_s=0.0,
        serve_timeout_s=300.0,
        lost_stage_grace_s=0.0,
    )
    assigned: list[str] = []
    await assignments._assign_available("j", reg.available("j", 2), assigned, 1)
    assert bus.published == {} and assigned == [] and said == []
    reg.announce(_joining("a"))
    reg.announce(_joining("b"))
    grow = asyncio.create_task(assignments.grow("j", 2, assigned))
    await asyncio.sleep(0)
    assignments.changed.set()
    async with asyncio.timeout(10.0):
        while len(bus.published) < 2:
            await asyncio.sleep(0.01)
    grow.cancel()
    assert sorted(bus.published) == ["a", "b"] and sorted(assigned) == ["a", "b"]
