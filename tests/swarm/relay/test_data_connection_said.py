"""A relayed call whose data connection back to the relay fails is said in the NAT'd peer's log
(WARNING, once a minute): its caller got a 504 and the peer's log had nothing, so a relay that
took the peer's attachment but refused its data connections (a firewall opened for one port of
two, a relay at its descriptor limit) failed every relayed call without a trace."""

from __future__ import annotations

import asyncio
import logging

import pytest

from swarm.relay.attach import Attachment
from tests.support.ports import free_address

pytestmark = pytest.mark.timeout(30)


async def test_a_relayed_calls_failed_data_connection_is_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    own = await asyncio.start_server(answering, "127.0.0.1", 0)  # the peer's own gRPC server
    host, port = own.sockets[0].getsockname()[:2]
    relay = free_address()  # nothing listens there: the data connection is refused
    attachment = Attachment("peer-1", "token", f"{host}:{port}", lambda: [relay], lambda _: None)
    try:
        with caplog.at_level(logging.WARNING, "swarm.relay.attach"):
            for call in ("c1", "c2"):
                await attachment._tunnel(relay, call, f"{host}:{port}")
    finally:
        own.close()
        await own.wait_closed()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said  # rated: once a minute
    assert f"data connection to relay {relay} failed" in said[0], said
