"""`swarm aggregator`: its flags (the stage server's shared ones: token, TLS, host and ports,
/metrics), and the start of the aggregator peer (`stage_server.aggregator.main`)."""

from __future__ import annotations

import argparse
import asyncio

from stage_server.peer.flags import add_peer_flags
from stage_server.peer.limits import PeerLimits
from swarm.errors import SwarmError
from swarm.flags import (
    add_flag,
    add_metrics_token,
    at_least,
    env_name,
    metrics_token,
    token,
    warn_if_url_password,
)
from swarm.net.bandwidth import parse_bandwidth
from swarm.net.ports import Listener, PortFlag, naming
from swarm.ops import faults
from swarm.ops.logs import show_at_default

__all__ = ["add_arguments", "parse_bandwidth", "run"]

_PORT = PortFlag(Listener.GRPC, "--port", env_name("aggregator-port"))
_METRICS_PORT = PortFlag(Listener.METRICS, "--metrics-port", env_name("aggregator-metrics-port"))
_PEERS = PeerLimits()
GiB = 1 << 30


def add_arguments(command: str, p: argparse.ArgumentParser) -> None:
    add_flag(
        p,
        "broker",
        None,
        "MQTT broker URL of the swarm, mqtt://[user:pass@]host:port or mqtts://... (required)",
    )
    add_peer_flags(p)
    add_flag(
        p,
        "announce-host",
        "",
        "address the pools' members dial to reach this aggregator (default: --host; required "
        "with --host 0.0.0.0)",
    )
    add_flag(p, "port", 0, "gRPC port (0: any free port)", env="aggregator-port", type=int)
    add_flag(
        p,
        "metrics-port",
        None,
        "serve /metrics on this port (0: any free port)",
        env="aggregator-metrics-port",
        type=int,
    )
    add_metrics_token(p)
    add_flag(
        p,
        "bandwidth",
        "",
        "this machine's link rates, UP/DOWN in bits per second as tc writes them (100mbit, "
        "1gbit; a plain 100M is Mbit/s), announced so that pools give it parts by its links "
        "(default: measured from the rounds it serves, announced again as they move)",
    )
    add_flag(
        p,
        "max-memory-bytes",
        GiB,
        "most bytes of received parts held at once, over every pool; a part past it is refused "
        "(RESOURCE_EXHAUSTED) and its round retried",
        type=int,
    )
    add_flag(
        p,
        "max-message-bytes",
        _PEERS.max_message_bytes,
        "largest gRPC message received or sent (bytes)",
        type=int,
    )
    add_flag(
        p,
        "max-concurrent-rpcs",
        _PEERS.max_concurrent_rpcs,
        "gRPC calls served at once; past it, refused",
        type=int,
    )
    add_flag(p, "threads", 1, "torch threads for the sums", type=at_least(1))


def run(command: str, args: argparse.Namespace) -> int:
    from swarm.net.tokens import refuse_open_host  # here: --help needs no gRPC

    warn_if_url_password(args, "broker")
    if not args.broker:
        raise SwarmError(
            "give --broker URL (or SWARM_BROKER): an aggregator serves a swarm's pools"
        )
    refuse_open_host(
        "the aggregator", args.host, token=token(args), insecure=args.insecure_no_token
    )
    up, down = parse_bandwidth(args.bandwidth) if args.bandwidth else (0.0, 0.0)
    faults.arm()  # a malformed SWARM_FAULTS stops it now, not at its first fault point
    # Imported here: `swarm aggregator --help` needs only the flags, not torch and gRPC.
    from stage_server.aggregator.main import AggregatorOptions, run_aggregator

    opts = AggregatorOptions(
        host=args.host,
        port=args.port,
        announce_host=args.announce_host,
        metrics_port=args.metrics_port,
        metrics_token=metrics_token(args),
        peer=args.peer,
        token=token(args),
        max_memory_bytes=args.max_memory_bytes,
        max_message_bytes=args.max_message_bytes,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        upload_bytes_per_second=up,
        download_bytes_per_second=down,
        threads=args.threads,
    )
    # What it does, and its link rates as they are measured and announced (its parts follow).
    show_at_default(("stage_server.aggregator.main", "stage_server.peer.links"))
    with naming(args.host, [(_PORT, args.port), (_METRICS_PORT, args.metrics_port)]):
        asyncio.run(run_aggregator(opts, args.broker))
    return 0
