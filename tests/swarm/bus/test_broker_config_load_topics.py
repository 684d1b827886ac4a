"""Issue 44 N3, on real Mosquitto as `swarm broker-config` writes it: Mosquitto bounds no one
user's retained messages and its ACL cannot see the retain flag, so what bounds a peer's retained
data there is the number of topics it may write. Each peer writes two, whatever their job
(`peers/{peer}` and `peers/{peer}/load`, the job inside the load report): a peer retaining on
hundreds of made-up topics leaves at most those two retained, and every fresh subscriber is sent
no more of it."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import pytest

from swarm.bus.topics import DEFAULT_PREFIX
from tests.support.mosquitto import written_mosquitto
from tests.support.raw_mqtt import RawClient, packet, publish_packet

pytestmark = [pytest.mark.timeout(120), pytest.mark.attack("N3")]

P = DEFAULT_PREFIX
MADE_UP_JOBS = 300  # load topics of made-up jobs
MADE_UP_LEVELS = 20  # of each shape under the peer's own topic
SUBSCRIBE, SUBACK, PINGREQ, PINGRESP, PUBLISH = 0x82, 0x90, 0xC0, 0xD0, 0x30


def _made_up_topics() -> list[str]:
    """Topics a peer "a" might hope to write: load topics of made-up jobs (what the ACL granted
    before), and levels under its own announcement."""
    jobs = [f"{P}jobs/made-up-{i}/load/a" for i in range(MADE_UP_JOBS)]
    levels = [f"{P}peers/a/{i}" for i in range(MADE_UP_LEVELS)]
    return jobs + levels + [f"{P}peers/a/load/{i}" for i in range(MADE_UP_LEVELS)]


def _subscribe(pattern: str) -> bytes:
    name = pattern.encode()
    return packet(SUBSCRIBE, struct.pack("!HH", 1, len(name)) + name + b"\x00")


async def _read_packet(raw: RawClient, timeout: float) -> tuple[int, bytes]:
    """(first byte, body) of the next packet the broker sends."""
    async with asyncio.timeout(timeout):
        first = (await raw.reader.readexactly(1))[0]
        length, shift = 0, 0
        while True:
            digit = (await raw.reader.readexactly(1))[0]
            length |= (digit & 0x7F) << shift
            shift += 7
            if not digit & 0x80:
                break
        return first, await raw.reader.readexactly(length)


async def _retained_now(raw: RawClient, pattern: str) -> dict[str, bytes]:
    """The retained messages a fresh subscription to `pattern` is sent, by topic: what the broker
    holds; a ping sent behind the SUBSCRIBE is answered after them."""
    await raw.send(_subscribe(pattern) + packet(PINGREQ, b""))
    first, body = await _read_packet(raw, 10.0)
    assert first == SUBACK and body[-1] == 0, (first, body)
    retained: dict[str, bytes] = {}
    while True:
        first, body = await _read_packet(raw, 30.0)
        if first == PINGRESP:
            return retained
        assert first & 0xF0 == PUBLISH, hex(first)
        (size,) = struct.unpack("!H", body[:2])
        if first & 0x01:  # retain: sent because the broker holds it (QoS 0: no packet id)
            retained[body[2 : 2 + size].decode()] = body[2 + size :]


async def test_a_peer_retains_on_two_topics_at_most_whatever_it_makes_up(
    tmp_path: Path, broker_certs: Path
) -> None:
    with written_mosquitto(tmp_path, broker_certs, {"a": None, "b": None}) as broker:
        log = broker.log
        async with await broker.connect("a") as flooder:
            for topic in _made_up_topics():
                await flooder.send(publish_packet(topic, b"junk " + topic.encode(), retain=True))
            # its own two topics, as an honest peer writes them (a retained announcement, a load
            # report: retained too, since Mosquitto cannot refuse the flag) ...
            await flooder.send(publish_packet(f"{P}peers/a", b"announcement", retain=True))
            await flooder.send(publish_packet(f"{P}peers/a/load", b"load", retain=True))
            await flooder.send(packet(PINGREQ, b""))  # answered once all of it is handled
            first, _ = await _read_packet(flooder, 30.0)
            assert first == PINGRESP, hex(first)
        async with await broker.connect("b") as fresh:
            retained = await _retained_now(fresh, f"{P}#")
        assert set(retained) == {f"{P}peers/a", f"{P}peers/a/load"}, (
            f"{len(retained)} retained messages of peer a: {sorted(retained)[:5]}...\n"
            + log.read_text()[-1000:]
        )
        assert retained[f"{P}peers/a"] == b"announcement"
