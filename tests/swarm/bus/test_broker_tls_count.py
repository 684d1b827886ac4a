"""Under TLS the embedded broker counts a connection from its first byte, before the handshake:
silent TCP connections past the cap are closed at once (300 of them, uncounted while their
handshake waited, took every descriptor of the scheduler), a silent one is closed after the
connect timeout, and an honest client still gets in."""

from __future__ import annotations

import asyncio

import pytest

from swarm.bus.broker import EmbeddedBroker
from swarm.bus.limits import BrokerLimits
from tests.support.buses import WAIT_S, bus
from tests.support.raw_mqtt import RawClient

pytestmark = pytest.mark.timeout(90)


async def _honest_client_connects(broker: EmbeddedBroker) -> None:
    async with bus(broker.url, "honest") as honest:
        await honest.wait_connected(WAIT_S)


@pytest.mark.attack("N5")
async def test_silent_tls_connections_past_the_cap_are_closed_at_once(tls_identity: None) -> None:
    limits = BrokerLimits(max_connections=3, connect_timeout_s=60.0)  # no timeout in this test
    async with EmbeddedBroker(limits=limits) as broker:
        assert broker.scheme == "mqtts"
        silent = [await RawClient.open("127.0.0.1", broker.port) for _ in range(12)]
        watching = [asyncio.ensure_future(s.closed_by_broker(WAIT_S)) for s in silent]
        try:
            # Counted as each is closed: once those past the cap are, the 3 the broker holds
            # (for its 60 s timeout) are not waited out to WAIT_S.
            closed = 0
            for each in asyncio.as_completed(watching):
                closed += await each
                if closed >= 12 - 3:
                    break
            assert closed >= 12 - 3, f"{closed} of 12 closed, the cap is 3"
        finally:
            for watch in watching:
                watch.cancel()
            await asyncio.gather(*watching, return_exceptions=True)
            for s in silent:
                await s.close()
        await _honest_client_connects(broker)  # the held ones gave their places back


@pytest.mark.attack("N5")
async def test_a_silent_tls_connection_is_closed_after_the_timeout(tls_identity: None) -> None:
    limits = BrokerLimits(max_connections=2, connect_timeout_s=1.0)
    async with EmbeddedBroker(limits=limits) as broker:
        silent = [await RawClient.open("127.0.0.1", broker.port) for _ in range(2)]
        try:
            assert all(await asyncio.gather(*(s.closed_by_broker(WAIT_S) for s in silent)))
        finally:
            for s in silent:
                await s.close()
        await _honest_client_connects(broker)
