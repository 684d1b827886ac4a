"""M-heads and M-fill (issue 54): one source cannot stop a relay, with idle connections holding its
request heads or with made-up attachments filling its peer places. Another 127.x address stands
for another machine: the relay sees its own source address."""

from __future__ import annotations

import asyncio
import base64
import contextlib

import pytest
from prometheus_client import CollectorRegistry

from swarm.net.paths import relay_credential
from swarm.relay.auth import data_proof
from swarm.relay.server import RelayLimits, RelayServer
from tests.support.relays import (
    NAT_HOST,
    Stream,
    echo_bytes,
    echo_server,
    home_peer,
    raw_attach,
    relayed,
)
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


@pytest.mark.attack("M-heads")
async def test_a_calls_data_connection_passes_a_full_pool_of_strangers_heads() -> None:
    """Strangers on two machines hold every head slot the moment a relayed call's data connection
    comes back: it has a pool of its own (before, it was refused as "busy", and the call failed
    after the relay's open timeout)."""
    registry = CollectorRegistry()
    relay = RelayServer(TOKEN, RelayLimits(max_heads=4, max_heads_per_source=2), registry=registry)
    address = f"127.0.0.1:{await relay.start('127.0.0.1', 0)}"
    host, port = address.rsplit(":", 1)
    held: list[Stream] = []
    try:
        answer, control = await raw_attach(address, "p", TOKEN, source="127.0.0.4")
        held.append(control)
        assert answer == "OK"
        caller = await asyncio.open_connection(host, int(port))
        held.append(caller)
        login = base64.b64encode(f"p:{relay_credential(TOKEN, 'p')}".encode()).decode()
        caller[1].write(
            f"CONNECT {NAT_HOST}:1 HTTP/1.1\r\nProxy-Authorization: Basic {login}\r\n\r\n".encode()
        )
        verb, call, _ = (await control[0].readline()).decode().split(" ")
        assert verb == "OPEN"
        for source in ("127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3", "127.0.0.5"):
            held.append(await asyncio.open_connection(host, int(port), local_addr=(source, 0)))
        await wait_until(
            lambda: registry.get_sample_value("swarm_relay_refused_total", {"reason": "busy"}),
            "the fifth stranger refused: every head slot held",
        )
        data = await asyncio.open_connection(host, int(port), local_addr=("127.0.0.4", 0))
        held.append(data)
        data[1].write(
            f"DATA {call} SWARM-RELAY/1\r\nAuthorization: Swarm {data_proof(TOKEN, call)}"
            "\r\n\r\n".encode()
        )
        status = await asyncio.wait_for(caller[0].readline(), 30)
        assert status == b"HTTP/1.1 200 Connection established\r\n"
    finally:
        await _close(held)
        await relay.stop()
