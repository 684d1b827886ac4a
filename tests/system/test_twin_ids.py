"""Two processes with one id on one host and one broker. Two `swarm relay` without `--peer`
each take an id of their own (`relay-HOSTNAME-PORT`): before, both took `relay-HOSTNAME` and kicked
each other off the broker a few times a second, silently. Given one id, the relay (or stage
server) started second stops with an error that names the id and `--peer`, and the first keeps
its id and its announcement."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from swarm.bus.broker import EmbeddedBroker
from swarm.bus.connection import Bus, BusSettings
from swarm.local.procs import SwarmProcess, start_process
from swarm.proto import control_pb2 as cpb
from tests.support.waiting import What, wait_until, wait_until_blocking

TOKEN = "relay-ids-token"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _relay(broker: str, tmp_path: Path, name: str, *flags: str) -> SwarmProcess:
    return start_process(
        ["relay", "--broker", broker, "--port", "0", *flags],
        log_dir=tmp_path,
        name=name,
        env={**os.environ, "SWARM_TOKEN": TOKEN},
    )


async def _watch(
    broker: str, done: Callable[[dict[str, cpb.PeerAnnouncement]], bool], what: What
) -> dict[str, cpb.PeerAnnouncement]:
    """The peers' announcements, by peer, once `done` says they are what was awaited."""
    seen: dict[str, cpb.PeerAnnouncement] = {}
    async with Bus(
        broker, "watcher", username="watcher", token=TOKEN, registry=CollectorRegistry()
    ) as bus:
        await bus.wait_connected(30)

        async def watch() -> None:
            async for _, message in bus.subscribe(bus.topics.peer("+")):
                assert isinstance(message, cpb.PeerAnnouncement)
                seen[message.peer] = message

        watching = asyncio.create_task(watch())
        await wait_until(lambda: done(seen), what)
        watching.cancel()
    return seen


async def _exited(process: SwarmProcess, what: str) -> int:
    """`process`'s exit code, once it exits by itself."""
    child = process.proc
    await asyncio.to_thread(
        wait_until_blocking, lambda: child.poll() is not None, what, timeout_s=90
    )
    return child.wait()


async def _stop(*processes: SwarmProcess) -> None:
    """Stop `processes` off the event loop, which runs the broker: a stop that blocked it kept
    each process from saying goodbye to the broker until its close timed out (10-14 s a test)."""
    await asyncio.gather(*(asyncio.to_thread(p.stop) for p in processes))


async def test_two_relays_on_one_host_take_an_id_each(tmp_path: Path) -> None:
    async with EmbeddedBroker(token=TOKEN) as broker:
        relays = [_relay(broker.url, tmp_path, f"relay-{i}") for i in range(2)]
        try:
            ready = [await asyncio.to_thread(r.wait_ready, 60) for r in relays]
            ids = [r["peer"] for r in ready]
            assert ids[0] != ids[1]
            for r in ready:
                assert r["peer"].endswith("-" + r["address"].rsplit(":", 1)[1])
            seen = await _watch(
                broker.url, lambda seen: all(p in seen for p in ids), "both relays' announcements"
            )
            for r in ready:
                assert seen[r["peer"]].state == cpb.PEER_STATE_SERVING
                assert seen[r["peer"]].relay_address == r["address"]
            for relay in relays:
                assert "lost" not in relay.log()  # neither was dropped by the broker
        finally:
            await _stop(*relays)


async def test_a_second_relay_with_the_same_id_stops_and_says_why(tmp_path: Path) -> None:
    async with EmbeddedBroker(token=TOKEN) as broker:
        first = _relay(broker.url, tmp_path, "first", "--peer", "twin")
        second = None
        try:
            ready = await asyncio.to_thread(first.wait_ready, 60)
            # A relay that has run a while: its connection is older than a takeover's drops.
            await asyncio.sleep(BusSettings().takeover_window_s)
            second = _relay(broker.url, tmp_path, "second", "--peer", "twin")
            assert await _exited(second, "the second relay to exit") == 2
            log = second.log()
            assert "swarm relay: error: another process is connected" in log
            assert "'relay-twin'" in log and "--peer twin-2" in log
            assert first.proc.poll() is None

            def kept(seen: dict[str, cpb.PeerAnnouncement]) -> bool:
                twin = seen.get("twin")
                return (
                    twin is not None
                    and twin.state == cpb.PEER_STATE_SERVING
                    and (twin.relay_address == ready["address"])
                )

            await _watch(broker.url, kept, "the first relay's announcement, serving")
        finally:
            await _stop(first, *([second] if second is not None else []))


@pytest.mark.parametrize("command", ["stage-server", "aggregator"])
async def test_a_peer_started_twice_with_one_id_stops_the_second(
    command: str, tmp_path: Path
) -> None:
    """The same for stage servers and aggregators: `--peer` given twice (or two machines with
    copies of one cache directory). Before, the two took turns on the broker for ever."""
    async with EmbeddedBroker() as broker:

        def peer(name: str) -> SwarmProcess:
            return start_process(
                [command, "--broker", broker.url, "--peer", "p1", "--port", "0"],
                log_dir=tmp_path,
                name=name,
                env={**os.environ, "SWARM_CACHE_DIR": str(tmp_path / name)},
            )

        first = peer("first")
        second = None
        try:
            await asyncio.to_thread(first.wait_ready, 120)
            await asyncio.sleep(BusSettings().takeover_window_s)  # as in the relays' test
            second = peer("second")
            code = await _exited(second, f"the second {command} to exit")
            log = second.log()
            assert code == 2, log[-2000:]
            assert f"swarm {command}: error: another process is connected" in log
            assert "'peer-p1'" in log and "--peer p1-2" in log
            assert "Traceback" not in log
            assert first.proc.poll() is None
        finally:
            await _stop(first, *([second] if second is not None else []))
