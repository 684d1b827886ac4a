"""The dial-back against what a hostile peer aims it at (issue 54): real ports on loopback, the
scheduler's own `StageDialer`. What the peer (and `swarm status`) is told never tells a closed
port from an HTTP/1 one, a silent one, another gRPC server or another peer's (M-scan); and peers
naming one silent host hold at most `per_host` of the dial-back's slots, so an honest newcomer
elsewhere is checked at once, not behind them all (Low: 200 such peers delayed one to 38 s)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from scheduler.dial_back import StageDialer
from scheduler.dial_scope import DialScope
from scheduler.reachability import ReachabilityChecker
from swarm.proto import control_pb2 as cpb
from swarm.proto import stage_pb2 as pb

pytestmark = pytest.mark.timeout(60)

INFO = "/swarm.proto.StageService/Info"


@contextlib.asynccontextmanager
async def grpc_server(
    host: str, info: Callable[[Any, Any], Awaitable[Any]] | None
) -> AsyncIterator[str]:
    """A real gRPC server on `host` (a loopback address) whose StageService.Info is `info`
    (None: no service at all, so UNIMPLEMENTED); its address."""
    server = grpc.aio.server()
    if info is not None:
        handler = grpc.unary_unary_rpc_method_handler(
            info,
            request_deserializer=pb.StageInfoRequest.FromString,
            response_serializer=pb.StageInfoResponse.SerializeToString,
        )
        generic = grpc.method_handlers_generic_handler(
            "swarm.proto.StageService", {"Info": handler}
        )
        server.add_generic_rpc_handlers((generic,))
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    try:
        yield f"{host}:{port}"
    finally:
        await server.stop(grace=None)


@contextlib.asynccontextmanager
async def raw_server(answer: bytes | None) -> AsyncIterator[str]:
    """A TCP server that answers every connection `answer` and closes (HTTP/1), or says nothing
    (None: silent); its address."""

    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        if answer is not None:
            writer.write(answer)
            await writer.drain()
            writer.close()
        else:
            await reader.read()  # until the caller hangs up

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


class Told:
    """A checker with the real dialer, and what it published and reported (status's)."""

    def __init__(self, **kwargs: Any) -> None:
        self.published: dict[str, cpb.ReachabilityReport] = {}
        self.reported: dict[str, cpb.ReachabilityReport] = {}
        self.arrived = asyncio.Event()
        self.checker = ReachabilityChecker(
            StageDialer(None),
            self._publish,
            self._report,
            scope=DialScope(allow_private=True),
            min_interval_s=0.0,
            **kwargs,
        )

    def _report(self, report: cpb.ReachabilityReport) -> None:
        self.reported[report.peer] = report

    async def _publish(self, peer: str, report: cpb.ReachabilityReport | None) -> None:
        if report is not None:
            self.published[peer] = report
            self.arrived.set()

    async def until(self, peers: set[str]) -> None:
        while not peers <= set(self.published):
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), 30)


@contextlib.asynccontextmanager
async def running(told: Told) -> AsyncIterator[Told]:
    task = asyncio.create_task(told.checker.run())
    try:
        yield told
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _announce(peer: str, address: str) -> cpb.PeerAnnouncement:
    return cpb.PeerAnnouncement(peer=peer, address=address, state=cpb.PEER_STATE_JOINING)


async def _as_other(request: Any, context: Any) -> pb.StageInfoResponse:
    return pb.StageInfoResponse(peer="someone-else")


async def _silent(request: Any, context: Any) -> pb.StageInfoResponse:
    await asyncio.Event().wait()  # the call is taken, and never answered
    raise AssertionError("unreachable")


@pytest.mark.attack("M-scan")
async def test_the_peer_learns_nothing_of_the_ports_it_names() -> None:
    # Before: another gRPC server (UNIMPLEMENTED) was taken for an aggregator, the peer placed
    # as DIRECT; another peer's port told "an error" (the scheduler's log: its peer id).
    async with contextlib.AsyncExitStack() as stack:
        ports = {
            "closed": _closed_port(),
            "http1": await stack.enter_async_context(
                raw_server(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            ),
            "silent": await stack.enter_async_context(raw_server(None)),
            "grpc": await stack.enter_async_context(grpc_server("127.0.0.1", None)),
            "peer": await stack.enter_async_context(grpc_server("127.0.0.1", _as_other)),
        }
        async with running(Told(timeout_s=1.0)) as told:
            for kind, address in ports.items():
                told.checker.announced(_announce(kind, address))
            await told.until(set(ports))
    seen = {(r.reachability, r.detail) for r in told.published.values()}
    assert seen == {(cpb.REACHABILITY_UNREACHABLE, "no answer")}, told.published
    assert told.reported == told.published  # status shows what the peer is told
    for kind, address in ports.items():
        said = told.published[kind].remedy
        assert said.startswith(f"nobody can dial {address}"), said
        assert "the scheduler's log names the cause" in said
    # The scheduler's own log keeps the cause: the operator's.
    assert "someone-else" in told.checker.reports["peer"].detail


@pytest.mark.attack("L-dial")
async def test_peers_naming_one_silent_host_do_not_hold_an_honest_newcomer_back() -> None:
    # 200 fake peers at a server that takes the call and never answers, then an honest peer on
    # another host. Before: it waited its turn behind all 200 (8 at a time, a deadline each).
    taken = [0]

    async def silent(request: Any, context: Any) -> pb.StageInfoResponse:
        taken[0] += 1
        return await _silent(request, context)

    async def honest(request: Any, context: Any) -> pb.StageInfoResponse:
        return pb.StageInfoResponse(peer="honest")

    async with (
        grpc_server("127.0.0.1", silent) as trap,
        grpc_server("127.0.0.2", honest) as home,
        running(Told(timeout_s=2.0)) as told,  # each silent dial holds its slot 2 s
    ):
        for i in range(200):
            told.checker.announced(_announce(f"fake-{i}", trap))
        told.checker.announced(_announce("honest", home))
        await told.until({"honest"})
        dials_before = taken[0]
    assert told.published["honest"].reachability == cpb.REACHABILITY_DIRECT
    assert dials_before <= 4, f"{dials_before} silent dials taken before the honest peer's check"


@pytest.mark.attack("L-dial")
async def test_peers_naming_many_silent_hosts_do_not_hold_an_honest_newcomer_back() -> None:
    # 200 fake peers, each at a silent server on a host of its own (127.1.i.1: the per-host
    # bound does not apply), announced first; the checks of the first ones begin; then an honest
    # newcomer. Before: the checks were queued as the peers came due, and it waited behind all
    # 200 (8 at a time, a 2 s deadline each: 50 s, growing with their number).
    taken = [0]
    began = asyncio.Event()

    async def silent(request: Any, context: Any) -> pb.StageInfoResponse:
        taken[0] += 1
        began.set()
        return await _silent(request, context)

    async def honest(request: Any, context: Any) -> pb.StageInfoResponse:
        return pb.StageInfoResponse(peer="honest")

    traps = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(
        silent,
        request_deserializer=pb.StageInfoRequest.FromString,
        response_serializer=pb.StageInfoResponse.SerializeToString,
    )
    traps.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("swarm.proto.StageService", {"Info": handler}),)
    )
    addresses = [f"127.1.{i}.1:{traps.add_insecure_port(f'127.1.{i}.1:0')}" for i in range(200)]
    await traps.start()
    try:
        async with (
            grpc_server("127.0.0.2", honest) as home,
            running(Told(timeout_s=2.0)) as told,  # each silent dial holds its slot 2 s
        ):
            for i, address in enumerate(addresses):
                told.checker.announced(_announce(f"fake-{i}", address))
            await asyncio.wait_for(began.wait(), 30)  # the fakes' checks hold the slots
            told.checker.announced(_announce("honest", home))
            await told.until({"honest"})
            dials_before = taken[0]
    finally:
        await traps.stop(grace=None)
    assert told.published["honest"].reachability == cpb.REACHABILITY_DIRECT
    # The 8 slots the fakes held when it came, and the few begun as the first of them ended.
    assert dials_before <= 16, f"{dials_before} silent dials taken before the honest peer's check"
