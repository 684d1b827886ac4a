"""The one dialer (`swarm.net.dial.channel`) waits for a server that is slow to answer a new
connection, within the call's own deadline: a loaded machine, TLS across an ocean and a relayed
path all take longer than a LAN's handshake. Before, the channel gave a connection attempt
250 ms (gRPC reads `grpc.min_reconnect_backoff_ms` as the least time an attempt is given), and a
call failed UNAVAILABLE: "connection attempt timed out before receiving SETTINGS frame" (a full
suite's `swarm export`, its scheduler busy on a loaded machine)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from swarm.net.dial import channel

SLOW_S = 1.5
"""How long the server's first bytes (its HTTP/2 SETTINGS) take: far over the old 250 ms, far
under a call's deadline."""


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, late_s: float = 0.0
) -> None:
    """`reader`'s bytes to `writer`, the first of them `late_s` late."""
    try:
        await asyncio.sleep(late_s)
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def _slow_to_answer(port: int) -> AsyncIterator[int]:
    """A port in front of `port` whose server answers each new connection `SLOW_S` late; the
    client's bytes go through at once."""
    pumps: set[asyncio.Task[None]] = set()

    async def carry(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", port)
        for pump in (_pump(client_r, server_w), _pump(server_r, client_w, SLOW_S)):
            task = asyncio.create_task(pump)
            pumps.add(task)
            task.add_done_callback(pumps.discard)

    front = await asyncio.start_server(carry, "127.0.0.1", 0)
    try:
        yield front.sockets[0].getsockname()[1]
    finally:
        front.close()
        for task in list(pumps):
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        await front.wait_closed()


async def test_a_server_slow_to_answer_a_new_connection_is_waited_for() -> None:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with _slow_to_answer(port) as slow:
            conn = channel(f"127.0.0.1:{slow}", token=None)
            try:
                check = health_pb2_grpc.HealthStub(conn).Check
                reply = await check(health_pb2.HealthCheckRequest(), timeout=10 * SLOW_S)
            finally:
                await conn.close()
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(None)
