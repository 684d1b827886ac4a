"""Two processes with one client id, against real brokers (amqtt and Mosquitto in turn): each
login drops the other's, so before `swarm.bus.takeover` the two kicked each other off a few times
a second, for ever and silently. Now the newcomer gives up with `BusTakenOver`, saying why and
what to do, and the client that was there first keeps its connection."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from swarm.bus.connection import BusSettings, BusTakenOver
from swarm.bus.takeover import Takeover, TakeoverWatch
from swarm.proto import control_pb2 as pb
from tests.support.brokers import BrokerUnderTest
from tests.support.buses import FAST, WAIT_S, bus, receive

pytestmark = pytest.mark.timeout(60)
SETTINGS = dataclasses.replace(FAST, takeover_window_s=1.0)


async def test_a_second_client_with_the_same_id_gives_up_and_the_first_keeps_it(
    broker: BrokerUnderTest,
) -> None:
    async with bus(broker.url, "relay-twin", settings=SETTINGS) as first:
        await first.wait_connected(WAIT_S)
        # As a process that has run a while: its connection is older than the window.
        await asyncio.sleep(SETTINGS.takeover_window_s)
        twin = bus(broker.url, "relay-twin", remedy="give it --peer ID", settings=SETTINGS)
        async with twin as second:
            why = await asyncio.wait_for(second.ended(), WAIT_S)
            assert isinstance(why, BusTakenOver)
            assert "'relay-twin'" in str(why) and str(why).endswith("give it --peer ID")
            with pytest.raises(BusTakenOver):
                await second.publish(second.topics.peer("relay-twin"), b"x")
        # The first is connected again, and stays: a message goes round through the broker.
        await first.wait_connected(WAIT_S)
        sub = first.subscribe(first.topics.peer("relay-twin"))
        await first.publish(
            first.topics.peer("relay-twin"), pb.PeerAnnouncement(peer="relay-twin"), True
        )
        _, message = await receive(sub)
        assert isinstance(message, pb.PeerAnnouncement) and message.peer == "relay-twin"


def test_only_quick_drops_in_a_row_count_and_the_one_that_held_the_id_keeps_it() -> None:
    newcomer = TakeoverWatch(BusSettings(takeover_after=3, takeover_window_s=2.0))
    assert newcomer.lost(0.3) is None and newcomer.lost(0.3) is None
    newcomer.refused()  # the broker away: not a twin
    assert newcomer.lost(0.3) is None and newcomer.lost(0.3) is None
    assert newcomer.lost(0.3) is Takeover.GIVE_UP

    first = TakeoverWatch(BusSettings(takeover_after=3, takeover_window_s=2.0))
    assert first.lost(60.0) is None  # it held the id a while: then the twin came
    said = [n for n in range(1, 25) if first.lost(0.3) is not None]
    assert said == [3, 6, 12, 24]  # it keeps the id and says so, less and less often
    assert first.lost(0.3) is None and first.dropped == 25
