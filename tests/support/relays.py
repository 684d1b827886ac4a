"""Relay harness for tests: a real gRPC server (health and a raw bytes echo, behind the swarm
token and the process's TLS identity) reached only through a real `RelayServer` and `Attachment`
(`relayed`), and the echo's bytes (`echo_bytes`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from prometheus_client import CollectorRegistry

from swarm.deadline import within
from swarm.net import dial, paths, tokens
from swarm.ops.rated import RatedLog
from swarm.relay.attach import Attachment
from swarm.relay.auth import attach_proof
from swarm.relay.identity import AttachKey, challenge
from swarm.relay.server import RelayLimits, RelayServer
from swarm.rpc import client_stream
from tests.support.waiting import wait_until

__all__ = [
    "ECHO",
    "NAT_HOST",
    "Relayed",
    "echo_bytes",
    "echo_server",
    "home_peer",
    "listener",
    "raw_attach",
    "relayed",
]

ECHO = "/test.Relay/Echo"
NAT_HOST = "nat-peer.invalid"
"""The host a NAT'd peer announces in these tests: it resolves nowhere, so a call that reaches
the peer at all went through the relay."""
MiB = 1 << 20
_OPTIONS = [("grpc.max_send_message_length", 8 * MiB), ("grpc.max_receive_message_length", 8 * MiB)]


async def _echo(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    async for r in requests:
        yield r


def _identity(b: bytes) -> bytes:
    return b


@contextlib.asynccontextmanager
async def echo_server(token: str | None) -> AsyncIterator[int]:
    """A gRPC server on 127.0.0.1 (TLS with the process's identity, if any): health and
    `ECHO`, a bidi stream of raw bytes; its port."""
    refusals = RatedLog(logging.getLogger("tests.relays"))
    server = grpc.aio.server(
        options=_OPTIONS,
        interceptors=tokens.server_interceptors(token, CollectorRegistry(), refusals),
    )
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    handler = grpc.stream_stream_rpc_method_handler(
        _echo, request_deserializer=_identity, response_serializer=_identity
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("test.Relay", {"Echo": handler}),)
    )
    port = tokens.add_port(server, "127.0.0.1:0", "the echo server")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(grace=None)


async def echo_bytes(address: str, token: str | None, parts: Sequence[bytes]) -> list[bytes]:
    """`parts` sent through `ECHO` at `address` (dialled by `dial.channel`); what came back."""
    async with dial.channel(address, token=token, options=_OPTIONS) as channel:
        call = channel.stream_stream(
            ECHO, request_serializer=_identity, response_deserializer=_identity
        )(timeout=30)
        got = []
        for part in parts:
            # a call the far end ended first (nothing listens there) raises its status, as
            # every stream of the service does, not grpc-aio's InvalidStateError
            await client_stream.write(call, part)
            got.append(await call.read())
        await client_stream.done_writing(call)
        return got


@dataclass
class Relayed:
    """A relay, a peer attached to it, and the address its callers dial."""

    relay: RelayServer
    attachment: Attachment
    relay_address: str
    peer: str
    announced: str
    registry: CollectorRegistry
    changes: list[str | None] = field(default_factory=list)

    @property
    def address(self) -> str:
        return paths.relayed_address(self.peer, self.announced, self.relay_address)


@contextlib.asynccontextmanager
async def relayed(
    token: str | None,
    port: int,
    *,
    peer: str = "home-gpu",
    limits: RelayLimits | None = None,
    attach_token: str | None = "same",
) -> AsyncIterator[Relayed]:
    """A relay on 127.0.0.1 and `peer` attached to it, serving its server on `port`, which it
    announces at `NAT_HOST`; the attachment's token is `token` unless `attach_token` says."""
    registry = CollectorRegistry()
    relay = RelayServer(token, limits, registry=registry)
    relay_port = await relay.start("127.0.0.1", 0)
    relay_address = f"127.0.0.1:{relay_port}"
    changes: list[str | None] = []
    attachment = Attachment(
        peer,
        token if attach_token == "same" else attach_token,
        f"127.0.0.1:{port}",
        lambda: [relay_address],
        changes.append,
        address=f"{NAT_HOST}:{port}",
    )
    await attachment.start()
    try:
        yield Relayed(
            relay, attachment, relay_address, peer, f"{NAT_HOST}:{port}", registry, changes
        )
    finally:
        await attachment.stop()
        await relay.stop()


@contextlib.asynccontextmanager
async def listener() -> AsyncIterator[tuple[int, list[bytes]]]:
    """A TCP listener on 127.0.0.1 (another service of the peer's LAN, an attacker's server):
    its port, and what each connection it accepted sent first."""
    got: list[bytes] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = b""
        with contextlib.suppress(ConnectionError, TimeoutError):
            first = await within(reader.read(1024), 5)
        got.append(first)
        writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], got
    finally:
        server.close()
        await server.wait_closed()


Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def raw_attach(
    relay: str, peer: str, token: str | None, *, source: str = "127.0.0.1", address: str = ""
) -> tuple[str, Stream]:
    """An attach as `peer` written by hand, from `source` (another 127.x address: another
    machine to the relay): the relay's last answer (`OK`, `ERR ...`, "" when it closed) and
    the connection."""
    host, port = relay.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port), local_addr=(source, 0))
    address, key = address or f"{NAT_HOST}:1", AttachKey.fresh()  # a made-up peer's own key
    writer.write(
        f"ATTACH {peer} SWARM-RELAY/1\r\nX-Swarm-Address: {address}\r\nX-Swarm-Relay: {relay}"
        f"\r\n{key.header()}\r\n\r\n".encode()
    )
    verb, _, nonce = (await reader.readline()).decode().strip().partition(" ")
    if verb != "NONCE":
        return f"{verb} {nonce}".strip(), (reader, writer)
    signed = key.sign(challenge(peer, relay, nonce))
    writer.write(f"PROOF {attach_proof(token, peer, nonce)} {signed}\n".encode())
    return (await reader.readline()).decode().strip(), (reader, writer)


@contextlib.asynccontextmanager
async def home_peer(
    relay: str, token: str | None, *, peer: str = "home-gpu", key: AttachKey | None = None
) -> AsyncIterator[tuple[Attachment, str]]:
    """`peer` behind NAT: an echo server, attached to `relay` (with `key`, else its own), waited
    for until attached; it and its dial address through the relay."""
    async with echo_server(token) as port:
        attachment = Attachment(
            peer,
            token,
            f"127.0.0.1:{port}",
            lambda: [relay],
            lambda _: None,
            address=f"{NAT_HOST}:{port}",
            key=key,
        )
        await attachment.start()
        try:
            await wait_until(lambda: attachment.relay is not None, f"{peer} attached")
            yield attachment, paths.relayed_address(peer, f"{NAT_HOST}:{port}", relay)
        finally:
            await attachment.stop()
