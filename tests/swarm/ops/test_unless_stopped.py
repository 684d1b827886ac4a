"""`unless_stopped`: a wait a SIGTERM cuts short, for a process's first seconds (a relay or a
stage server connecting to its broker, a peer behind NAT waiting for its relay). A relay
stopped while its broker did not answer ignored the signal for its connect timeout (30 s) and
then ended with the connect's error instead of stopping."""

from __future__ import annotations

import asyncio
import time

import pytest

from stage_server.relay import _announced_until_stopped, _Announcing
from swarm.ops.lifecycle import unless_stopped
from tests.support.ports import free_port


async def test_a_wait_ends_first_or_the_stop_cuts_it_short() -> None:
    stop = asyncio.Event()
    assert await unless_stopped(asyncio.sleep(0), stop)  # it ended first
    with pytest.raises(ValueError, match="its own error"):

        async def fails() -> None:
            raise ValueError("its own error")

        await unless_stopped(fails(), stop)
    asyncio.get_running_loop().call_later(0.1, stop.set)
    assert not await unless_stopped(asyncio.sleep(30), stop)  # stopped: cut short


async def test_a_relay_stopped_before_its_broker_answers_stops_then() -> None:
    stop = asyncio.Event()
    said = _Announcing("relay-1", "127.0.0.1:7999", "")
    asyncio.get_running_loop().call_later(0.5, stop.set)  # SIGTERM, half a second in
    started = time.monotonic()
    broker = f"mqtt://127.0.0.1:{free_port()}"  # nothing listens: the connect waits
    await asyncio.wait_for(_announced_until_stopped(broker, None, said, None, stop, 30.0), 10)
    assert time.monotonic() - started < 5
