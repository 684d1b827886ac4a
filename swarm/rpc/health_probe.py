"""`swarm health`: ask a role's gRPC health service whether it serves (the scheduler, a stage
server, an aggregator), as a container's health check does. Exit 0 when it answers SERVING, 1
when it answers anything else or nothing within the deadline, each with one line saying which.

The health service takes no token (an orchestrator probing it holds none), but over TLS the
probe speaks TLS with the process's identity (`--tls-ca`, or the role's own `SWARM_TLS_*`
variables, which a container already has)."""

from __future__ import annotations

import argparse
import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from swarm.flags import add_flag
from swarm.net import dial
from swarm.net.tls import add_tls_flags, configure_from_args

__all__ = ["add_arguments", "probe", "run"]


def add_arguments(command: str, p: argparse.ArgumentParser) -> None:
    add_flag(
        p,
        "health-address",
        "127.0.0.1:7700",
        "the role's gRPC address, host:port (the scheduler's job API, a stage server's --port)",
    )
    p.add_argument("--service", default="", help="the service to ask about ('': the server)")
    add_flag(p, "health-timeout", 5.0, "seconds to wait for the answer", type=float)
    add_tls_flags(p)


async def probe(address: str, service: str = "", timeout_s: float = 5.0) -> str:
    """The health service's answer at `address` (SERVING, NOT_SERVING, ...), or why none came."""
    channel = dial.channel(address, token=None)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    except grpc.aio.AioRpcError as e:
        return f"no answer ({e.code().name}: {e.details()})"
    finally:
        await channel.close()


def run(command: str, args: argparse.Namespace) -> int:
    configure_from_args(args)
    answer = asyncio.run(probe(args.health_address, args.service, args.health_timeout))
    print(f"{args.health_address}: {answer}")
    return 0 if answer == "SERVING" else 1
