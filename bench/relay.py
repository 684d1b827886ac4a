"""The tunnel evaluation of issue 42: one bare gRPC stream of the same bytes (256 MiB in 1 MiB
messages by default) sent direct, through `swarm.relay.server` (a relay process splicing a NAT'd
peer's own connections, on loopback) and through grpctunnel-py's reverse tunnel; prints each
one's MiB/s and its ratio to direct, in one run.

Direct and relayed run in pairs, the order alternating (direct first, then relayed first, ...),
so the machine's other load falls on both alike; each pair's ratio (relayed MiB/s over direct
MiB/s) is printed, then their median and spread, checked against the target (>= 0.5x direct,
issue 51): PASS or FAIL, and exit status 1 on FAIL.

    .venv/bin/python bench/relay.py [--mib 256] [--pairs 5] [--grpctunnel /work/gtvenv]

Processes: the peer (a gRPC server with a sink method, attached to the relay), the relay, and the
caller, each its own. grpctunnel-py carries RPCs to handlers registered on its tunnel (not to the
peer's own server), and only the process holding the tunnel can call through it, so there the
relay process is the caller too: one hop fewer than the others, which favours it. It is loaded
from `--grpctunnel` (a `pip install --target` directory, kept out of the project's
dependencies); when absent the row says "skipped: grpctunnel-py not installed".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import AsyncIterator
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.net import dial, paths
from swarm.relay.attach import Attachment
from swarm.relay.server import RelayServer

MiB = 1 << 20
TOKEN = "bench-token"
SINK = "/bench.Bench/Sink"
# What the NAT'd peer announces (a relay tunnels only to an address the peer announced): a name
# nobody resolves, so the relayed row cannot be a direct dial in disguise.
ANNOUNCED = "nat-peer.invalid"
TARGET = 0.5  # the relayed stream's share of direct (issue 51, item 8)
OPTIONS = [("grpc.max_send_message_length", 4 * MiB), ("grpc.max_receive_message_length", 4 * MiB)]


def _same(b: bytes) -> bytes:
    return b


async def _sink(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    total = 0
    async for r in requests:
        total += len(r)
    yield total.to_bytes(8, "big")


# -- the NAT'd peer ------------------------------------------------------------------------------
async def _peer(relay: str, ports: Queue[int], stop: Any) -> None:
    server = grpc.aio.server(options=OPTIONS)
    handler = grpc.stream_stream_rpc_method_handler(
        _sink, request_deserializer=_same, response_serializer=_same
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Bench", {"Sink": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    attachment = None
    if relay:
        attached = asyncio.Event()
        attachment = Attachment(
            "peer",
            TOKEN,
            f"127.0.0.1:{port}",
            lambda: [relay],
            lambda r: attached.set() if r else None,
            address=f"{ANNOUNCED}:{port}",
        )
        await attachment.start()
        await attached.wait()
    ports.put(port)
    while not stop.is_set():
        await asyncio.sleep(0.1)
    if attachment is not None:
        await attachment.stop()
    await server.stop(None)


async def _relay(ports: Queue[int], stop: Any) -> None:
    relay = RelayServer(TOKEN)
    ports.put(await relay.start("127.0.0.1", 0))
    while not stop.is_set():
        await asyncio.sleep(0.1)
    await relay.stop()


def _run(target: Any, *args: Any) -> None:
    asyncio.run(target(*args))


# -- the caller ------------------------------------------------------------------------------
async def _stream(call: Any, mib: int) -> float:
    """Seconds to send `mib` MiB through `call` and get the sink's count back."""
    chunk = b"\1" * MiB
    start = time.perf_counter()
    for _ in range(mib):
        await call.write(chunk)
    await call.done_writing()
    reply = await call.read()
    elapsed = time.perf_counter() - start
    assert int.from_bytes(reply, "big") == mib * MiB, "bytes lost"
    return elapsed


async def _pairs(addresses: list[str], mib: int, pairs: int) -> list[list[float]]:
    """Seconds of each address per pair, the order alternating from pair to pair (the first
    address first, then the last first, ...): the machine's other load falls on all alike."""
    async with contextlib.AsyncExitStack() as stack:
        methods = []
        for address in addresses:
            channel = dial.channel(address, token=TOKEN, options=OPTIONS)
            await stack.enter_async_context(channel)
            method = channel.stream_stream(
                SINK, request_serializer=_same, response_deserializer=_same
            )
            await _stream(method(), 8)  # warm: the connection, the tunnel
            methods.append(method)
        seconds = []
        for pair in range(pairs):
            order = list(range(len(methods)))
            if pair % 2:
                order.reverse()
            took = [0.0] * len(methods)
            for i in order:
                took[i] = await _stream(methods[i](), mib)
            seconds.append(took)
        return seconds


# -- grpctunnel-py -------------------------------------------------------------------------------
async def _tunnel_peer(relay: str, stop: Any) -> None:
    from grpctunnel import ReverseTunnelServer
    from grpctunnel.proto.v1 import tunnel_pb2_grpc

    async def sink(stream: Any, context: Any) -> None:
        total = 0
        while True:
            try:
                total += len(await stream.recv_message())
            except StopAsyncIteration:
                break
        await stream.send_message(total.to_bytes(8, "big"))

    async with grpc.aio.insecure_channel(relay, options=OPTIONS) as channel:
        server = ReverseTunnelServer(tunnel_pb2_grpc.TunnelServiceStub(channel))
        server.register_method(SINK.lstrip("/"), sink, is_client_stream=True, is_server_stream=True)
        serving = asyncio.create_task(server.serve())
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await server.stop()
        serving.cancel()


async def _tunnel_caller(mib: int, runs: int, results: Queue[float | str]) -> None:
    from grpctunnel import TunnelServiceHandler
    from grpctunnel.proto.v1 import tunnel_pb2_grpc

    handler = TunnelServiceHandler()
    server = grpc.aio.server(options=OPTIONS)
    tunnel_pb2_grpc.add_TunnelServiceServicer_to_server(handler.service(), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    results.put(float(port))
    try:
        channel = handler.as_channel()
        await channel.wait_for_ready(60)
        method = channel.stream_stream(SINK, _same, _same)
        await _stream(await method(), 8)
        results.put(statistics.median([await _stream(await method(), mib) for _ in range(runs)]))
    except Exception as e:  # the row says why, not a hang
        results.put(f"failed: {type(e).__name__}: {e}")
    finally:
        await server.stop(None)


def _grpctunnel(mib: int, runs: int) -> float | str:
    ctx = mp.get_context("spawn")
    results: Queue[float | str] = ctx.Queue()
    stop = ctx.Event()
    caller = ctx.Process(target=_run, args=(_tunnel_caller, mib, runs, results))
    caller.start()
    port = int(results.get(timeout=60))
    peer = ctx.Process(target=_run, args=(_tunnel_peer, f"127.0.0.1:{port}", stop))
    peer.start()
    try:
        return results.get(timeout=300)
    finally:
        stop.set()
        caller.join(10)
        peer.join(10)
        for p in (caller, peer):
            if p.is_alive():
                p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB per stream (1 MiB messages)")
    ap.add_argument("--pairs", type=int, default=5, help="direct/relayed pairs, order alternating")
    ap.add_argument("--grpctunnel", default="/work/gtvenv", help="where grpctunnel-py is")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    ports: Queue[int] = ctx.Queue()
    children = [ctx.Process(target=_run, args=(_relay, ports, stop))]
    children[0].start()
    relay = f"127.0.0.1:{ports.get(timeout=60)}"
    children.append(ctx.Process(target=_run, args=(_peer, relay, ports, stop)))
    children[1].start()
    port = ports.get(timeout=60)
    rows: list[tuple[str, float | str]] = []
    try:
        relayed = paths.relayed_address("peer", f"{ANNOUNCED}:{port}", relay)
        pairs = asyncio.run(_pairs([f"127.0.0.1:{port}", relayed], args.mib, args.pairs))
    finally:
        stop.set()
        for c in children:
            c.join(10)
    ratios = [direct / through for direct, through in pairs]
    median = statistics.median(ratios)
    direct_s = statistics.median(d for d, _ in pairs)
    rows += [
        ("direct", direct_s),
        ("swarm relay (loopback)", statistics.median(t for _, t in pairs)),
    ]
    sys.path.insert(0, args.grpctunnel)
    try:
        import grpctunnel  # noqa: F401
    except ImportError:
        rows.append(("grpctunnel-py reverse tunnel", "skipped: grpctunnel-py not installed"))
    else:
        rows.append(("grpctunnel-py reverse tunnel", _grpctunnel(args.mib, args.pairs)))
    print(f"{args.mib} MiB in 1 MiB messages, {args.pairs} pairs, order alternating")
    for n, (direct, through) in enumerate(pairs):
        first = "relayed" if n % 2 else "direct"
        print(
            f"pair {n} ({first} first): direct {args.mib / direct:6.0f} MiB/s, relayed "
            f"{args.mib / through:6.0f} MiB/s, relayed/direct {direct / through:.2f}"
        )
    print(f"{'path (median of its runs)':32} {'MiB/s':>8} {'x direct':>9}")
    for name, seconds in rows:
        if isinstance(seconds, str):
            print(f"{name:32} {seconds}")
        else:
            print(f"{name:32} {args.mib / seconds:8.0f} {direct_s / seconds:9.2f}")
    verdict = "PASS" if median >= TARGET else "FAIL"
    print(
        f"relayed/direct per pair: median {median:.2f}, spread {min(ratios):.2f}-"
        f"{max(ratios):.2f}: {verdict} (>= {TARGET}x direct)"
    )
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
