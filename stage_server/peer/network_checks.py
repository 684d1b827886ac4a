"""`swarm doctor`'s network checks, made as the peer will make them: a real login to the broker
(MQTT CONNECT with the peer's id and the swarm token, over TLS when the URL is `mqtts://`), a real
authenticated call to the scheduler (ListJobs with the token, through the one dialer), and the
path others will take to this machine (direct, or behind NAT through which relay).

Only opening a TCP connection, as the doctor once did, passed with a wrong token and without TLS
against a TLS-only swarm; each of those is now a failure naming its fix.

The path is judged before anything starts: the scheduler says the address it saw the call come
from (`SchedulerListJobsResponse.caller_host`); another one than this machine has toward it means
a router translated it (behind NAT), and the relays announced on the bus say which relay will
carry calls to it. The scheduler's dial-back (`scheduler.reachability`) measures it for good once
the peer announces itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import secrets
import socket
from dataclasses import dataclass
from typing import TypeGuard

import grpc
from prometheus_client import CollectorRegistry

from swarm.bus.connection import (
    Bus,
    BusAuthError,
    BusNotConnected,
    BusRefused,
    BusSettings,
)
from swarm.bus.topics import parse_broker_url
from swarm.net.dial import channel
from swarm.net.tls_mismatch import explain_grpc
from swarm.ops.printable import shown
from swarm.proto import control_pb2 as cpb
from swarm.proto import scheduler_pb2, scheduler_pb2_grpc

__all__ = ["Check", "broker_login", "path_check", "scheduler_call"]

_TOKEN_FIX = (
    "use the swarm's token (the scheduler's --token-file), or ask for a new invite "
    "(`swarm invite NAME` on the scheduler's host) and pass --join FILE"
)


@dataclass(frozen=True)
class Check:
    """One finding: `fix` is what to do, "" when it passed."""

    name: str
    ok: bool
    found: str
    fix: str = ""

    def line(self) -> str:
        head = f"{'ok  ' if self.ok else 'FAIL'} {self.name}: {self.found}"
        return head if self.ok else f"{head}\n     fix: {self.fix}"


async def broker_login(
    url: str, peer: str, token: str | None, timeout: float
) -> tuple[Check, dict[str, str]]:
    """A login to the broker at `url` as `peer` with `token`, and the relays announced there
    (peer -> its relay address), read from the retained announcements."""
    try:
        address = parse_broker_url(url)
    except Exception as e:  # a malformed URL is the finding
        return Check("broker", False, f"{url!r}: {e}", "give --broker as mqtt[s]://HOST:PORT"), {}
    client = f"{peer or 'swarm'}-doctor-{secrets.token_hex(3)}"  # never a running peer's id
    # An attempt shorter than the wait: a broker that never answers is named by its error.
    settings = BusSettings(operation_timeout_s=max(0.5, timeout / 2), reconnect_max_s=0.5)
    bus = Bus(
        url,
        client,
        token=token,
        username=peer or None,
        registry=CollectorRegistry(),
        settings=settings,
    )
    relays: dict[str, str] = {}
    who = f"as {peer}" if peer else "with the swarm token" if token else "without a token"
    async with bus:
        try:
            await bus.wait_connected(timeout)
        except BusAuthError as e:
            return Check(
                "broker", False, f"{address.url} refused the login {who} ({e})", _TOKEN_FIX
            ), {}
        except (
            BusRefused
        ) as e:  # TLS on one side only, or a certificate refused: said with the flag
            return Check(
                "broker", False, str(e), "pass the swarm's TLS files (--tls-ca ...) or --join FILE"
            ), {}
        except BusNotConnected as e:
            fix = "start the broker (or the scheduler that embeds it), or fix --broker's host:port"
            return Check("broker", False, str(e), fix), {}
        # Retained announcements arrive at once after the subscription; a short read gets them.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(timeout, 1.5)):
                async for _, message in bus.subscribe(bus.topics.peer("+")):
                    if _relays_now(message):
                        relays[message.peer] = message.relay_address
    tls = "over TLS" if url.startswith("mqtts://") else "in clear text"
    return Check("broker", True, f"{address.url} accepted the login {who}, {tls}"), relays


def _relays_now(message: object) -> TypeGuard[cpb.PeerAnnouncement]:
    """Whether `message` announces a relay others may attach to (present, reached directly)."""
    return (
        isinstance(message, cpb.PeerAnnouncement)
        and bool(message.relay_address)
        and message.state != cpb.PEER_STATE_OFFLINE
        and not message.relay
    )


async def scheduler_call(address: str, token: str | None, timeout: float) -> tuple[Check, str]:
    """ListJobs at the scheduler `address` with `token` (it answers only a caller it lets in),
    and this machine's address as the scheduler saw the call ("" from a scheduler that does not
    say)."""
    backoff = [("grpc.max_reconnect_backoff_ms", int(timeout * 1000))]
    conn = channel(address, token=token, options=backoff)
    request = scheduler_pb2.SchedulerListJobsRequest(page_size=1)
    tls_fix = "pass the swarm's TLS files (--tls-ca ...) or --join FILE"
    try:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(conn)
        reply = await stub.ListJobs(request, timeout=timeout)
    except grpc.aio.AioRpcError as e:
        details = e.details() or ""
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            found = f"{address} refused the swarm token ({details})"
            return Check("scheduler", False, found, _TOKEN_FIX), ""
        tls = explain_grpc(address, details, "the scheduler")
        if tls is not None:
            return Check("scheduler", False, f"{address}: {tls}", tls_fix), ""
        found = f"{address} does not answer ({e.code().name}: {details})"
        fix = "start the scheduler, or fix --scheduler (its --port, printed at its start)"
        return Check("scheduler", False, found, fix), ""
    finally:
        await conn.close()
    jobs = "jobs listed" if reply.jobs else "no jobs yet"
    found = f"{address} answered an authenticated call ({jobs})"
    return Check("scheduler", True, found), reply.caller_host


def local_host(address: str) -> str:
    """This machine's address toward `address` (a broker URL or HOST:PORT): a UDP socket's
    connect sends nothing, it only asks the kernel for the route."""
    target = parse_broker_url(address) if "://" in address else None
    host, port = (target.host, target.port) if target else address.rsplit(":", 1)
    family, _, _, _, where = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(where)
        return str(s.getsockname()[0])


def path_check(local: str, seen: str, relays: dict[str, str]) -> Check:
    """How others will reach this machine: `local`, its own address toward the scheduler, and
    `seen`, the address the scheduler saw it call from; `relays`, those announced. Another
    address seen than the one it has means a router translated it: behind NAT."""
    if not seen:
        found = "not judged: the scheduler does not say whom it sees (an older one)"
        return Check("path", True, found)
    if ipaddress.ip_address(local) == ipaddress.ip_address(seen):
        found = f"direct: the scheduler sees this machine as {local}, its own address"
        return Check("path", True, found + " (its dial-back confirms at start)")
    nat = f"behind NAT (this machine is {local}; the scheduler sees {seen}, its router)"
    if not relays:
        return Check(
            "path",
            False,
            f"{nat}, and no relay is announced: nobody can dial it",
            "start a relay on a host others reach (`swarm relay`, or a stage server with "
            "--relay): docs/deployment.md, 'Peers behind NAT'; or forward a port and give "
            "--announce-host",
        )
    # Announced by whoever holds the token: escaped, as `swarm status` shows them (issue 64.10)
    named = ", ".join(f"{shown(peer)} ({shown(addr)})" for peer, addr in sorted(relays.items()))
    return Check("path", True, f"{nat} → relayed via {named}")
