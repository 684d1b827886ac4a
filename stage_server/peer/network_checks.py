"""`swarm doctor`'s network checks, made as the peer will make them: a real login to the broker
(MQTT CONNECT with the peer's id and the swarm token, over TLS when the URL is `mqtts://`), a real
authenticated call to the scheduler (ListJobs with the token, through the one dialer), and the
path others will take to this machine (direct, or behind NAT through which relay).

Only opening a TCP connection, as the doctor once did, passed with a wrong token and without TLS
against a TLS-only swarm; each of those is now a failure naming its fix.

The path is judged before anything starts, from what this machine can see: the address it
reaches the broker from (a private one toward a broker outside it: behind NAT) and the relays
announced on the bus. The scheduler's dial-back (`scheduler.reachability`) measures it for good
once the peer announces itself.
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
from swarm.proto import control_pb2 as cpb
from swarm.proto import scheduler_pb2, scheduler_pb2_grpc

__all__ = ["Check", "broker_login", "path_check", "scheduler_call"]

_TOKEN_FIX = (
    "use the swarm's token (the scheduler's --token-file), or ask for a new invite "
    "(`swarm invite NAME` on the scheduler's host) and pass --join FILE"
)
# Addresses a home router hands out: a machine holding one reaches the internet through NAT.
_PRIVATE = [
    ipaddress.ip_network(n)
    for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7")
]


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


async def scheduler_call(address: str, token: str | None, timeout: float) -> Check:
    """ListJobs at the scheduler `address` with `token`: it answers only a caller it lets in."""
    conn = channel(
        address, token=token, options=[("grpc.max_reconnect_backoff_ms", int(timeout * 1000))]
    )
    try:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(conn)
        reply = await stub.ListJobs(
            scheduler_pb2.SchedulerListJobsRequest(page_size=1), timeout=timeout
        )
    except grpc.aio.AioRpcError as e:
        details = e.details() or ""
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            return Check(
                "scheduler", False, f"{address} refused the swarm token ({details})", _TOKEN_FIX
            )
        tls = explain_grpc(address, details, "the scheduler")
        if tls is not None:
            return Check(
                "scheduler",
                False,
                f"{address}: {tls}",
                "pass the swarm's TLS files (--tls-ca ...) or --join FILE",
            )
        fix = "start the scheduler, or fix --scheduler (its --port, printed at its start)"
        return Check(
            "scheduler", False, f"{address} does not answer ({e.code().name}: {details})", fix
        )
    finally:
        await conn.close()
    jobs = "jobs listed" if reply.jobs else "no jobs yet"
    return Check("scheduler", True, f"{address} answered an authenticated call ({jobs})")


def local_address(broker_url: str) -> tuple[str, str]:
    """(this machine's address toward the broker, the broker's address): a UDP socket's
    connect sends nothing, it only asks the kernel for the route."""
    address = parse_broker_url(broker_url)
    family, _, _, _, target = socket.getaddrinfo(
        address.host, address.port, type=socket.SOCK_DGRAM
    )[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(target)
        return str(s.getsockname()[0]), str(target[0])


def _private(host: str) -> bool:
    ip = ipaddress.ip_address(host)
    return ip.is_loopback or any(ip in n for n in _PRIVATE if n.version == ip.version)


def path_check(local: str, broker: str, relays: dict[str, str]) -> Check:
    """How others will reach this machine: `local`, its address toward the `broker`'s address;
    `relays`, those announced. A private address toward a broker outside it is behind NAT."""
    if not _private(local) or _private(broker):
        where = "a public address" if not _private(local) else "on the broker's network"
        found = f"direct: this machine is {local}, {where} (the scheduler dials it back at start)"
        return Check("path", True, found)
    if not relays:
        return Check(
            "path",
            False,
            f"behind NAT (this machine is {local}, a private address; the broker is at "
            f"{broker}), and no relay is announced",
            "start a relay on a host others reach (`swarm relay`, or a stage server with "
            "--relay): docs/deployment.md, 'Peers behind NAT'",
        )
    named = ", ".join(f"{peer} ({addr})" for peer, addr in sorted(relays.items()))
    found = f"behind NAT (this machine is {local}, a private address) → relayed via {named}"
    return Check("path", True, found)
