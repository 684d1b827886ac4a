"""Which connection a full metrics endpoint drops, when a scrape's bytes are still in the kernel.

The endpoint's thread reads a connection's bytes when it gets to them; a scrape's request line
and token can wait unread while a flood of unfinished requests from its own host fills the
endpoint (a loaded machine: seen in suite runs, "a scrape was cut off: Connection reset by
peer", tests/swarm/ops/test_metrics_churn.py). Unread, the token has vouched for nothing yet, so
the scrape was "the oldest unfinished request without a valid token" and dropped. The endpoint
looks at a connection's unread bytes (a peek) before it drops it: a token there vouches.
Real connections on loopback; reading paused as a starved thread's would be."""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from swarm.ops.endpoint import Answer, Endpoint, _Heard, _unread

HOST = "127.0.0.1"
SCRAPE = b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer s3cret\r\n"
TRICKLE = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"  # a slowloris request, never ended
HEAD_BYTES = 16 * 1024


@asynccontextmanager
async def _accepted(
    sent: list[bytes], read: list[bool]
) -> AsyncIterator[tuple[list[asyncio.StreamWriter], list[asyncio.StreamWriter]]]:
    """The server ends of connections that sent `sent`, oldest first, and their client ends;
    the server ends not `read` with their bytes still in the kernel, the others with all of
    them read out."""
    accepted: list[asyncio.StreamWriter] = []

    def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not read[len(accepted)]:  # before any byte is read: they stay in the kernel
            writer.transport.pause_reading()
        accepted.append(writer)

    server = await asyncio.start_server(accept, HOST, 0)
    port = server.sockets[0].getsockname()[1]
    clients: list[asyncio.StreamWriter] = []
    try:
        for data in sent:  # one at a time: accepted in this order
            _, out = await asyncio.open_connection(HOST, port)
            out.write(data)
            await out.drain()
            clients.append(out)
            async with asyncio.timeout(10):
                while len(accepted) < len(clients):
                    await asyncio.sleep(0.01)
        async with asyncio.timeout(10):  # each connection's bytes where they should be
            while any(
                bool(_unread(w, HEAD_BYTES)) == r for w, r in zip(accepted, read, strict=True)
            ):
                await asyncio.sleep(0.01)
        yield accepted, clients
    finally:
        for writer in clients + accepted:
            writer.transport.abort()
        server.close()


def _victim(
    accepted: list[asyncio.StreamWriter], sent: list[bytes], read: list[bool]
) -> asyncio.StreamWriter:
    """The connection an endpoint holding `accepted` (all of one host) drops for a new one."""
    endpoint = Endpoint(lambda path, headers: Answer(200, b"ok\n"), token="s3cret")
    heard = {w: _Heard(endpoint._expected, HEAD_BYTES) for w in accepted}
    for writer, data, was_read in zip(accepted, sent, read, strict=True):
        if was_read:  # what the endpoint's reader heard of it: all of its bytes
            heard[writer].feed_data(data)
    endpoint._open = {w: (HOST, heard[w]) for w in accepted}  # oldest first
    return endpoint._victim(HOST)


async def test_a_scrape_whose_token_waits_unread_is_not_the_one_dropped() -> None:
    # The scrape first (the oldest), none of it read; then the flood's, each read as it came.
    sent, read = [SCRAPE, TRICKLE, TRICKLE, TRICKLE], [False, True, True, True]
    async with _accepted(sent, read) as (accepted, _):
        assert _victim(accepted, sent, read) is accepted[1]


async def test_a_scrape_is_not_dropped_when_no_connection_has_been_read() -> None:
    # The endpoint's thread starved: it accepted a batch and admits each before reading any, so
    # every connection of the host has unread bytes. The oldest of them was dropped: the scrape.
    sent, read = [SCRAPE, TRICKLE, TRICKLE, TRICKLE], [False, False, False, False]
    async with _accepted(sent, read) as (accepted, _):
        assert _victim(accepted, sent, read) is accepted[1]


async def test_unread_bytes_that_hold_no_token_do_not_shield_a_connection() -> None:
    # A flood's connection with bytes waiting goes before a read one younger than it: unread
    # bytes alone no longer vouch, only a token among them.
    sent, read = [TRICKLE, TRICKLE, SCRAPE], [False, True, True]
    async with _accepted(sent, read) as (accepted, _):
        assert _victim(accepted, sent, read) is accepted[0]


async def test_a_connection_reset_before_its_task_ended_is_no_error() -> None:
    # A client's reset closes the server's socket at once (its descriptor -1), while the
    # connection stays among the endpoint's open ones until its task ends: a peek at it raised
    # ValueError out of the admission, and the newcomer, a scrape perhaps, was closed.
    sent, read = [TRICKLE, SCRAPE], [True, False]
    async with _accepted(sent, read) as (accepted, clients):
        client = clients[0]
        client.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
        )
        client.transport.abort()  # a reset, with SO_LINGER's zero
        async with asyncio.timeout(10):
            while accepted[0].get_extra_info("socket").fileno() >= 0:
                await asyncio.sleep(0.01)
        assert _victim(accepted, sent, read) is accepted[0]


async def test_a_connection_handed_over_with_bytes_waiting_has_spoken() -> None:
    # Under TLS the reader hears only what the handshake decrypts: a scrape mid-handshake,
    # its hello read, looked silent and went first. What the kernel held for it when it was
    # handed over is its first bytes, heard or not.
    endpoint = Endpoint(lambda path, headers: Answer(200, b"ok\n"), token="s3cret")
    async with _accepted([b"\x16\x03\x01"], [False]) as ((writer,), _):
        heard = _Heard(endpoint._expected, HEAD_BYTES)
        endpoint._admit(heard, writer)
        assert heard.spoke and not heard.vouched


async def test_under_tls_bytes_waiting_may_hold_a_token_and_none_waiting_go_first() -> None:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    endpoint = Endpoint(lambda path, headers: Answer(200, b"ok\n"), token="s3cret", context=context)
    sent, read = [b"\x16\x03\x01", TRICKLE], [False, True]
    async with _accepted(sent, read) as (accepted, _):
        heard = {w: _Heard(endpoint._expected, HEAD_BYTES) for w in accepted}
        heard[accepted[0]].spoke = heard[accepted[1]].spoke = True
        endpoint._open = {w: (HOST, heard[w]) for w in accepted}
        assert endpoint._victim(HOST) is accepted[1]


def test_a_silent_connection_is_handed_over_only_once_it_speaks() -> None:
    endpoint = Endpoint(lambda path, headers: Answer(200, b"ok\n"), token="s3cret")
    port = endpoint.start(HOST, 0)
    with socket.create_connection((HOST, port), timeout=10) as client:
        time.sleep(0.3)
        assert not endpoint._open  # in the kernel, not a slot of the endpoint's
        client.sendall(b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer s3cret\r\n\r\n")
        assert client.recv(64).startswith(b"HTTP/1.1 200")
