"""The MQTT bus against a broker in another process (slow): what tests/swarm/bus/test_connection.py
checks in one process, across a real process boundary."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap

import pytest

from swarm.proto import control_pb2 as pb
from tests.support.brokers import BrokerUnderTest
from tests.support.buses import bus, receive_until
from tests.support.cli import ROOT

pytestmark = pytest.mark.timeout(60)


_CHILD = textwrap.dedent("""
    import asyncio, sys
    from swarm.bus.connection import Bus, BusSettings
    from swarm.proto import control_pb2 as pb

    async def main() -> None:
        url = sys.argv[1]
        will = ("swarm/v1/peers/p1", pb.PeerAnnouncement(peer="p1", state=pb.PEER_STATE_OFFLINE))
        async with Bus(url, "p1", will=will, settings=BusSettings(keepalive_s=1)) as bus:
            await bus.wait_connected(10)
            serving = pb.PeerAnnouncement(peer="p1", state=pb.PEER_STATE_SERVING)
            await bus.publish(bus.topics.peer("p1"), serving, retain=True)
            print("ready", flush=True)
            await asyncio.Event().wait()

    asyncio.run(main())
""")


@pytest.mark.slow
async def test_last_will_marks_killed_peer_offline(broker: BrokerUnderTest) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CHILD, broker.url, cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), 20)
        assert line.strip() == b"ready", line
        async with bus(broker.url, "watcher") as watcher:
            peers = watcher.subscribe(watcher.topics.peer("p1"))
            await receive_until(peers, lambda _, m: m.state == pb.PEER_STATE_SERVING)  # type: ignore[attr-defined]
            child.kill()  # SIGKILL: no clean disconnect, only the broker can speak for p1
            await receive_until(peers, lambda _, m: m.state == pb.PEER_STATE_OFFLINE, 15)  # type: ignore[attr-defined]
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()
