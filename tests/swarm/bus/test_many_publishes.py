"""Many publishes at once are no trouble said: aiomqtt warns ("There are N pending publish
calls") past ten awaiting their PUBACK, and an ended job's assignments are withdrawn all at once
(`scheduler.assignments.Assignments.withdraw`, one retained publish per peer): every job of
eleven peers or more ended with a WARNING per peer past the tenth, which read as a broker in
trouble."""

from __future__ import annotations

import asyncio
import logging

import pytest

from swarm.bus.broker import EmbeddedBroker
from swarm.bus.topics import Topics
from swarm.proto import control_pb2 as pb
from tests.support.buses import WAIT_S, bus

pytestmark = pytest.mark.timeout(60)

PEERS = 40


async def test_a_job_ends_with_forty_withdrawals_at_once_and_nothing_is_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    topics = Topics()
    async with EmbeddedBroker() as broker, bus(broker.url, "scheduler") as b:
        await b.wait_connected(WAIT_S)
        caplog.set_level(logging.INFO)
        await asyncio.gather(
            *(b.publish(topics.assign("j", f"p{k}"), b"", retain=True) for k in range(PEERS))
        )
        # they were sent: one more, after them, is confirmed too
        await b.publish(topics.peer("scheduler"), pb.PeerAnnouncement(address="a:1"))
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not warned, warned
