"""M-heads and M-fill (issue 54): one source cannot stop a relay, with idle connections holding its
request heads or with made-up attachments filling its peer places. Another 127.x address stands
for another machine: the relay sees its own source address."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from prometheus_client import CollectorRegistry

from swarm.relay.server import RelayServer
from tests.support.relays import Stream, echo_bytes, echo_server, home_peer, raw_attach, relayed
from tests.support.waiting import wait_until

TOKEN = "relay-quota-token"
ELSEWHERE = "127.0.0.2"  # the attacker's machine
pytestmark = pytest.mark.timeout(120)


async def _close(streams: list[Stream]) -> None:
    for _, writer in streams:
        writer.close()
    for _, writer in streams:
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


@pytest.mark.attack("M-heads")
async def test_idle_connections_from_one_source_stop_no_relayed_call() -> None:
    """140 connections from one machine that never send a head. Before: they held all 128 head
    slots (10 s each, again and again), and relayed calls were refused."""
    async with echo_server(TOKEN) as port, relayed(TOKEN, port) as r:
        await wait_until(lambda: r.attachment.relay is not None)
        host, relay_port = r.relay_address.rsplit(":", 1)
        idle: list[Stream] = []
        try:
            for _ in range(140):
                idle.append(
                    await asyncio.open_connection(host, int(relay_port), local_addr=(ELSEWHERE, 0))
                )
            await wait_until(
                lambda: (
                    (
                        (
                            r.registry.get_sample_value(
                                "swarm_relay_refused_total", {"reason": "busy"}
                            )
                        )
                        or 0
                    )
                    >= 12
                ),
                "the relay holding every head it takes from them",
            )
            for i in range(25):
                assert await echo_bytes(r.address, TOKEN, [b"%d" % i]) == [b"%d" % i]
        finally:
            await _close(idle)


@pytest.mark.attack("M-fill")
async def test_made_up_attachments_from_one_source_leave_room_for_the_real_peer() -> None:
    """A token holder attaches 256 made-up peer ids from its machine. Before: they took every
    peer place (256), and the real peer could not attach."""
    registry = CollectorRegistry()
    relay = RelayServer(TOKEN, registry=registry)
    address = f"127.0.0.1:{await relay.start('127.0.0.1', 0)}"
    held: list[Stream] = []
    answers: list[str] = []
    try:
        for i in range(256):
            answer, stream = await raw_attach(address, f"made-up-{i}", TOKEN, source=ELSEWHERE)
            answers.append(answer)
            held.append(stream)
        assert answers.count("OK") < 256
        async with home_peer(address, TOKEN):
            assert "home-gpu" in relay.peers
    finally:
        await _close(held)
        await relay.stop()
