"""MQTT 3.1.1 packets written by hand, for tests that must send what no well-behaved client
sends: a wrong password under someone else's client id, a persistent session, a forged last-will,
an oversized packet, or nothing at all."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from dataclasses import dataclass

__all__ = ["RawClient", "Will", "connect_packet", "packet", "publish_packet", "subscribe_packet"]

CONNECT, CONNACK, PUBLISH, SUBSCRIBE = 0x10, 0x20, 0x30, 0x82


@dataclass(frozen=True)
class Will:
    topic: str
    payload: bytes
    retain: bool = True
    qos: int = 1


def _remaining_length(n: int) -> bytes:
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _str(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    return struct.pack("!H", len(raw)) + raw


def packet(first_byte: int, body: bytes) -> bytes:
    """A packet: its fixed header (type and flags, remaining length), then `body`."""
    return bytes([first_byte]) + _remaining_length(len(body)) + body


def connect_packet(
    client_id: str,
    *,
    username: str | None = None,
    password: str | None = None,
    clean: bool = True,
    will: Will | None = None,
    keepalive: int = 60,
) -> bytes:
    flags = (0x02 if clean else 0) | (0x80 if username is not None else 0)
    flags |= 0x40 if password is not None else 0
    payload = _str(client_id)
    if will is not None:
        flags |= 0x04 | (will.qos << 3) | (0x20 if will.retain else 0)
        payload += _str(will.topic) + _str(will.payload)
    payload += _str(username) if username is not None else b""
    payload += _str(password) if password is not None else b""
    header = _str("MQTT") + bytes([4, flags]) + struct.pack("!H", keepalive)
    return packet(CONNECT, header + payload)


def publish_packet(
    topic: str, payload: bytes, *, retain: bool = False, qos: int = 0, packet_id: int = 0
) -> bytes:
    """A PUBLISH (QoS 0 unless `qos`; a packet id with QoS 1 or 2)."""
    first = PUBLISH | (qos << 1) | (0x01 if retain else 0)
    ident = struct.pack("!H", packet_id) if qos else b""
    return packet(first, _str(topic) + ident + payload)


def subscribe_packet(packet_id: int, topic: str, *, qos: int = 0) -> bytes:
    """A SUBSCRIBE to one topic filter at `qos`."""
    return packet(SUBSCRIBE, struct.pack("!H", packet_id) + _str(topic) + bytes([qos]))


class RawClient:
    """A TCP connection to a broker that speaks only the packets a test writes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, host: str, port: int) -> RawClient:
        return cls(*await asyncio.open_connection(host, port))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def connack(self, timeout: float) -> int | None:
        """The CONNACK's return code (0: accepted); None when the broker closed without one."""
        try:
            async with asyncio.timeout(timeout):
                head = await self.reader.readexactly(4)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        assert head[0] == CONNACK, f"not a CONNACK: {head!r}"
        return head[3]

    async def closed_by_broker(self, timeout: float) -> bool:
        """Whether the broker closes this connection within `timeout` (reading whatever came)."""
        try:
            async with asyncio.timeout(timeout):
                while await self.reader.read(65536):
                    pass
        except TimeoutError:
            return False
        except ConnectionError:
            pass
        return True

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()

    async def __aenter__(self) -> RawClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
