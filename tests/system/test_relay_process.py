"""`swarm relay` as its own process: it announces itself on the bus (role RELAY, its listener),
carries a NAT'd peer's calls, and on SIGTERM announces itself offline before it stops."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from swarm.bus.broker import EmbeddedBroker
from swarm.bus.connection import Bus
from swarm.local.procs import start_process
from swarm.net import paths
from swarm.proto import control_pb2 as cpb
from swarm.relay.attach import Attachment
from tests.support.relays import NAT_HOST, echo_bytes, echo_server
from tests.support.waiting import wait_until

TOKEN = "relay-process-token"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


async def test_a_relay_process_announces_itself_carries_calls_and_says_when_it_goes(
    tmp_path: Path,
) -> None:
    async with EmbeddedBroker(token=TOKEN) as broker:
        relay = start_process(
            [
                "--log-level",
                "INFO",
                "relay",
                "--broker",
                broker.url,
                "--port",
                "0",
                "--peer",
                "relay-1",
                "--metrics-port",
                "0",
            ],
            log_dir=tmp_path,
            name="relay",
            env={**os.environ, "SWARM_TOKEN": TOKEN},
        )
        try:
            ready = await asyncio.to_thread(relay.wait_ready, 60)
            seen: list[cpb.PeerAnnouncement] = []
            async with Bus(
                broker.url, "watcher", username="watcher", token=TOKEN, registry=CollectorRegistry()
            ) as bus:
                await bus.wait_connected(30)

                async def watch() -> None:
                    async for _, message in bus.subscribe(bus.topics.peer("relay-1")):
                        assert isinstance(message, cpb.PeerAnnouncement)
                        seen.append(message)

                watching = asyncio.create_task(watch())
                await wait_until(lambda: bool(seen))
                assert seen[0].role == cpb.PEER_ROLE_RELAY
                assert seen[0].state == cpb.PEER_STATE_SERVING
                assert seen[0].relay_address == ready["address"]
                assert seen[0].metrics_address.endswith(f":{ready['metrics']}")

                async with echo_server(TOKEN) as port:
                    changes: list[str | None] = []
                    attachment = Attachment(
                        "home-gpu",
                        TOKEN,
                        f"127.0.0.1:{port}",
                        lambda: [ready["address"]],
                        changes.append,
                        address=f"{NAT_HOST}:{port}",
                    )
                    await attachment.start()
                    try:
                        await wait_until(lambda: attachment.relay == ready["address"])
                        address = paths.relayed_address(
                            "home-gpu", f"{NAT_HOST}:{port}", ready["address"]
                        )
                        assert await echo_bytes(address, TOKEN, [b"through"]) == [b"through"]
                        assert await asyncio.to_thread(relay.stop) == 0
                        await wait_until(lambda: seen[-1].state == cpb.PEER_STATE_OFFLINE)
                        await wait_until(lambda: attachment.relay is None)
                        assert changes == [ready["address"], None]
                    finally:
                        await attachment.stop()
                watching.cancel()
        finally:
            relay.stop()
        assert "announced offline" in relay.log()


async def test_a_sigkilled_relay_process_is_replaced_and_calls_resume(tmp_path: Path) -> None:
    """Two relay processes; the one the peer attached to is SIGKILLed: the peer attaches to the
    other, and its calls through it go on."""
    env = {**os.environ, "SWARM_TOKEN": TOKEN}
    relays = [
        start_process(
            ["relay", "--port", "0", "--peer", f"relay-{i}"],
            log_dir=tmp_path,
            name=f"relay-{i}",
            env=env,
        )
        for i in range(2)
    ]
    try:
        a, b = [(await asyncio.to_thread(r.wait_ready, 60))["address"] for r in relays]
        async with echo_server(TOKEN) as port:
            changes: list[str | None] = []
            attachment = Attachment(
                "home-gpu",
                TOKEN,
                f"127.0.0.1:{port}",
                lambda: [a, b],
                changes.append,
                address=f"{NAT_HOST}:{port}",
            )
            await attachment.start()
            try:
                await wait_until(lambda: attachment.relay == a)
                via = {
                    r: paths.relayed_address("home-gpu", f"{NAT_HOST}:{port}", r) for r in (a, b)
                }
                assert await echo_bytes(via[a], TOKEN, [b"one"]) == [b"one"]
                relays[0].proc.kill()
                await wait_until(lambda: attachment.relay == b)
                assert await echo_bytes(via[b], TOKEN, [b"two"]) == [b"two"]
                assert changes == [a, b]  # straight to the other: never announced relay-less
            finally:
                await attachment.stop()
    finally:
        for r in relays:
            r.stop()
