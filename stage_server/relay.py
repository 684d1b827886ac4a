"""`swarm relay`: a directly reachable process that carries calls to stage servers behind NAT
(`swarm.relay.server`). It announces itself on the bus like a peer (`peers/{peer}`, role RELAY, its
listener in `relay_address`, a last will that says it is gone), so NAT'd peers find it and attach;
it serves no stage and is never placed. Its /metrics (`swarm_relay_*`) if asked.

Its id (`--peer`) is by default `relay-HOSTNAME-PORT`, its bound port's: a second relay on the
same host (another port) is a relay of its own, not the first one's twin. Two relays given one id
(or on two hosts of one name and port) would kick each other off the broker for ever: the one
started second sees it and stops with the error (`swarm.bus.takeover`).

Shutdown in order: announced offline first (peers re-choose), then the listener and every
tunnel closed."""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import socket
import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from swarm.errors import SwarmError
from swarm.flags import (
    add_flag,
    add_insecure_no_token,
    add_metrics_token,
    add_token,
    metrics_token,
    token,
    warn_if_url_password,
)
from swarm.net.invite import add_join_flag
from swarm.net.tls import add_tls_flags
from swarm.ops.logs import show_at_default
from swarm.relay.server import RelayLimits

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from swarm.bus.connection import Bus, BusRefused
    from swarm.proto import control_pb2 as cpb
    from swarm.relay.server import RelayServer

__all__ = ["add_arguments", "run", "run_relay"]

log = logging.getLogger(__name__)
DEFAULT_PORT = 7100
_LIMITS = (
    "max_peers",
    "max_peers_per_source",
    "max_tunnels_per_peer",
    "max_tunnels",
    "max_tunnels_per_source",
)


def add_arguments(command: str, p: argparse.ArgumentParser) -> None:
    add_flag(
        p,
        "broker",
        None,
        "MQTT broker URL: the relay announces itself there (none: it "
        "only listens; peers are then given its address)",
    )
    add_flag(
        p, "peer", "", "its peer id and MQTT username (default: relay-HOSTNAME-PORT, its port's)"
    )
    add_token(p)
    add_insecure_no_token(p)
    add_tls_flags(p)
    add_join_flag(p)
    add_flag(p, "host", "127.0.0.1", "address to listen on (0.0.0.0 or :: for every interface)")
    add_flag(p, "announce-host", "", "address peers dial to reach the relay (default: --host)")
    add_flag(p, "port", DEFAULT_PORT, "relay port (0: any free port)", env="relay-port", type=int)
    add_flag(
        p,
        "metrics-port",
        None,
        "serve /metrics on this port (0: any free port)",
        env="relay-metrics-port",
        type=int,
    )
    add_metrics_token(p)
    p.add_argument(
        "--print-metrics-credential",
        action="store_true",
        help="print the password "
        "Prometheus shows a relay of this swarm (its proxy_url) and exit: it opens "
        "tunnels to the peers' metrics addresses only",
    )
    defaults = RelayLimits()
    for name in _LIMITS:
        flag = name.replace("_", "-")
        add_flag(p, flag, getattr(defaults, name), f"bound: {flag.replace('-', ' ')}", type=int)


def limits(args: argparse.Namespace) -> RelayLimits:
    given = {f.name: getattr(args, f.name) for f in fields(RelayLimits) if f.name in _LIMITS}
    return RelayLimits(**given)


def default_peer(port: int) -> str:
    """`relay-HOSTNAME-PORT`: one host's relays listen on distinct ports, so each has its own."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()) or "host"
    return f"relay-{host}-{port}"


def run(command: str, args: argparse.Namespace) -> int:
    from swarm.net.tokens import refuse_open_host  # here: --help needs no gRPC

    if args.print_metrics_credential:  # derived from the token: the same for every relay
        from swarm.relay.auth import metrics_credential

        print(metrics_credential(token(args)) or "(no token: a relay checks no credential)")
        return 0
    warn_if_url_password(args, "broker")
    refuse_open_host("the relay", args.host, token=token(args), insecure=args.insecure_no_token)
    show_at_default(("stage_server.relay", "swarm.relay.server"))
    asyncio.run(
        run_relay(
            args.host,
            args.port,
            broker=args.broker,
            peer=args.peer,
            token=token(args),
            announce_host=args.announce_host,
            metrics_port=args.metrics_port,
            metrics_token=metrics_token(args),
            limits=limits(args),
        )
    )
    return 0


async def run_relay(
    host: str,
    port: int,
    *,
    broker: str | None,
    peer: str,
    token: str | None,
    announce_host: str = "",
    metrics_port: int | None = None,
    metrics_token: str | None = None,
    limits: RelayLimits | None = None,
    connect_timeout_s: float = 30.0,
) -> None:
    """Serve the relay until SIGTERM/SIGINT; announced on `broker` when given, as `peer`
    ("": `default_peer` of the port it bound). Another process announcing with its id: a
    `BusTakenOver` naming `--peer`."""
    from prometheus_client import CollectorRegistry

    from swarm.net.addresses import announced_host, host_port
    from swarm.ops.lifecycle import install_signal_handlers, print_ready
    from swarm.ops.metrics import serve_metrics
    from swarm.relay.limits import raise_nofile

    announced_host(host, announce_host, "the relay")  # checked before anything starts
    registry = CollectorRegistry()
    raise_nofile()  # its limits are sized to the descriptors it may open
    relay = _relay_server(token, limits, registry)
    metrics = None
    if metrics_port is not None:
        metrics = serve_metrics(registry, host, metrics_port, token=metrics_token or token)
    try:
        bound = await relay.start(host, port)
    except OSError as e:
        raise SwarmError(
            f"the relay cannot listen on {host_port(host, port)}: {e.strerror}"
        ) from None
    address = host_port(announced_host(host, announce_host, "the relay"), bound)
    relay.addresses.add(address)  # what peers sign their attaches for
    metrics_address = "" if metrics is None else host_port(address.rpartition(":")[0], metrics)
    said = _Announcing(peer or default_peer(bound), address, metrics_address)
    stop = asyncio.Event()
    install_signal_handlers(stop)
    try:
        if broker is None:
            print_ready("relay", peer=said.peer, address=address, metrics=metrics)
            await stop.wait()
            return
        await _announced_until_stopped(broker, token, said, metrics, stop, connect_timeout_s)
    finally:
        await relay.stop()


def _relay_server(
    token: str | None, limits: RelayLimits | None, registry: CollectorRegistry
) -> RelayServer:
    """The relay, not yet listening. With the swarm's CA, only a certificate naming a peer
    attaches as that peer."""
    from swarm.net import tls
    from swarm.ops.rated import RatedLog
    from swarm.relay.server import RelayServer

    identity = tls.current()
    ca = identity.ca if identity is not None else None
    return RelayServer(token, limits, registry=registry, refusals=RatedLog(log), ca=ca)


@dataclass(frozen=True, slots=True)
class _Announcing:
    """What the relay says of itself on `peers/{peer}`: its role, where peers attach, its
    metrics."""

    peer: str
    address: str  # its listener, as peers dial it
    metrics_address: str  # "": no /metrics

    def announcement(self, state: cpb.PeerState) -> cpb.PeerAnnouncement:
        from swarm.proto import control_pb2 as cpb

        return cpb.PeerAnnouncement(
            peer=self.peer,
            state=state,
            role=cpb.PEER_ROLE_RELAY,
            relay_address=self.address,
            metrics_address=self.metrics_address,
            time=time.time(),
        )


async def _announced_until_stopped(
    broker: str,
    token: str | None,
    said: _Announcing,
    metrics: int | None,
    stop: asyncio.Event,
    connect_timeout_s: float,
) -> None:
    """Serving, announced on the bus (its last will says it is gone) until a signal; then
    announced offline first, so peers attached here re-choose while the tunnels still carry.
    Raises `BusRefused` where another process took the relay's id or the broker refused it."""
    from swarm.bus.connection import Bus
    from swarm.bus.topics import Topics
    from swarm.ops.lifecycle import print_ready, unless_stopped
    from swarm.proto import control_pb2 as cpb

    peer = said.peer
    will = (Topics().peer(peer), said.announcement(cpb.PEER_STATE_OFFLINE))
    remedy = f"stop the other relay, or give this one an id of its own (--peer {peer}-2)"
    async with Bus(
        broker,
        client_id=f"relay-{peer}",
        username=peer,
        token=token,
        will=will,
        remedy=remedy,
    ) as bus:
        if not await unless_stopped(bus.wait_connected(connect_timeout_s), stop):
            log.info("relay %s: stopped (SIGTERM or SIGINT) before the broker answered", peer)
            return
        await bus.publish(bus.topics.peer(peer), said.announcement(cpb.PEER_STATE_SERVING), True)
        print_ready("relay", peer=peer, address=said.address, metrics=metrics)
        if (gone := await _ended_or_stopped(bus, stop)) is not None:
            raise gone  # the relay that had the id keeps it, and its announcement
        await bus.publish(bus.topics.peer(peer), said.announcement(cpb.PEER_STATE_OFFLINE), True)
        log.info("relay %s: stopped (SIGTERM or SIGINT); announced offline", peer)


async def _ended_or_stopped(bus: Bus, stop: asyncio.Event) -> BusRefused | None:
    """Wait for SIGTERM/SIGINT (None) or for the bus to give up (why: another process took the
    relay's id, or the broker refused its login)."""
    ended = asyncio.create_task(bus.ended())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({ended, stopped}, return_when=asyncio.FIRST_COMPLETED)
    for task in (ended, stopped):
        task.cancel()
    return ended.result() if ended.done() and not ended.cancelled() else None
