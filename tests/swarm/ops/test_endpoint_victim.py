"""Which connection a full metrics endpoint drops, when a scrape's bytes are still in the kernel.

The endpoint's thread reads a connection's bytes when it gets to them; a scrape's request line
and token can wait unread while a flood of unfinished requests from its own host fills the
endpoint (a loaded machine: seen once in a suite run, "a scrape was cut off: Connection reset by
peer", tests/swarm/ops/test_metrics_churn.py). Unread, the token has vouched for nothing yet, so
the scrape was "the oldest unfinished request without a valid token" and dropped. Unread bytes
may hold a token: such a connection goes after every unvouched one whose bytes are all read.
Real connections on loopback; the scrape's reading paused as a starved thread's would be."""

from __future__ import annotations

import asyncio

from swarm.ops.endpoint import Answer, Endpoint, _Heard, _unread

HOST = "127.0.0.1"
SCRAPE = b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer s3cret\r\n"
TRICKLE = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"  # a slowloris request, never ended


async def test_a_scrape_whose_token_waits_unread_is_not_the_one_dropped() -> None:
    endpoint = Endpoint(lambda path, headers: Answer(200, b"ok\n"), token="s3cret")
    accepted: list[asyncio.StreamWriter] = []
    paused = {"next": True}

    def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if paused["next"]:  # before any byte is read: they stay in the kernel
            writer.transport.pause_reading()
        accepted.append(writer)

    server = await asyncio.start_server(accept, HOST, 0)
    port = server.sockets[0].getsockname()[1]
    clients: list[asyncio.StreamWriter] = []
    try:
        # The scrape first (the oldest), its request line and token sent, none of it read.
        _, scrape_out = await asyncio.open_connection(HOST, port)
        scrape_out.write(SCRAPE)
        await scrape_out.drain()
        clients.append(scrape_out)
        paused["next"] = False
        floods = []
        for _ in range(3):  # then the flood's, from the same host, each read as it came
            _, out = await asyncio.open_connection(HOST, port)
            out.write(TRICKLE)
            await out.drain()
            clients.append(out)
            floods.append(out)
        async with asyncio.timeout(10):
            while len(accepted) < len(clients):
                await asyncio.sleep(0.01)
        scrape, flood = accepted[0], accepted[1:]
        heard: dict[asyncio.StreamWriter, _Heard] = {}
        for writer in accepted:
            heard[writer] = _Heard(endpoint._expected, 16 * 1024)
        for writer in flood:  # what the endpoint's reader heard of each: all of its bytes
            heard[writer].feed_data(TRICKLE)
        async with asyncio.timeout(10):  # the flood's bytes read out of the kernel
            while any(_unread(w) for w in flood) or not _unread(scrape):
                await asyncio.sleep(0.01)
        endpoint._open = {w: (HOST, heard[w]) for w in accepted}  # oldest first

        assert endpoint._victim(HOST) is flood[0]
    finally:
        for writer in clients + accepted:
            writer.transport.abort()
        server.close()
