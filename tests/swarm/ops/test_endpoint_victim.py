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
) -> AsyncIterator[list[asyncio.StreamWriter]]:
    """The server ends of connections that sent `sent`, oldest first; those not `read` with
    their bytes still in the kernel, the others with all of them read out."""
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
        yield accepted
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
    async with _accepted(sent, read) as accepted:
        assert _victim(accepted, sent, read) is accepted[1]


async def test_a_scrape_is_not_dropped_when_no_connection_has_been_read() -> None:
    # The endpoint's thread starved: it accepted a batch and admits each before reading any, so
    # every connection of the host has unread bytes. The oldest of them was dropped: the scrape.
    sent, read = [SCRAPE, TRICKLE, TRICKLE, TRICKLE], [False, False, False, False]
    async with _accepted(sent, read) as accepted:
        assert _victim(accepted, sent, read) is accepted[1]


async def test_unread_bytes_that_hold_no_token_do_not_shield_a_connection() -> None:
    # A flood's connection with bytes waiting goes before a read one younger than it: unread
    # bytes alone no longer vouch, only a token among them.
    sent, read = [TRICKLE, TRICKLE, SCRAPE], [False, True, True]
    async with _accepted(sent, read) as accepted:
        assert _victim(accepted, sent, read) is accepted[0]
