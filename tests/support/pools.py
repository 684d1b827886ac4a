"""Real pool replicas for averaging tests: one gRPC server, `Averager` and `PoolServicer` each, on
127.0.0.1 port 0, serving job `JOB` stages 0 and 1."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from stage_server.averaging.channels import ChannelPool
from stage_server.averaging.owner import Averager
from stage_server.averaging.service import PoolServicer
from swarm.errors import NotFound
from swarm.proto import pool_pb2_grpc

__all__ = ["JOB", "OPTIONS", "MiB", "Replica", "replicas"]

MiB = 1 << 20
JOB = "job-a"
OPTIONS = [
    ("grpc.max_send_message_length", 64 * MiB),
    ("grpc.max_receive_message_length", 64 * MiB),
]


@dataclass
class Replica:
    address: str
    averager: Averager
    channels: ChannelPool
    server: grpc.aio.Server


def _route(job: str, stage: int) -> None:
    if job != JOB or stage not in (0, 1):
        raise NotFound(f"job {job!r} stage {stage} is not served here")


@contextlib.asynccontextmanager
async def replicas(n: int) -> AsyncIterator[list[Replica]]:
    made: list[Replica] = []
    try:
        for _ in range(n):
            server = grpc.aio.server(options=OPTIONS)
            averager = Averager()
            servicer = PoolServicer(
                averager, route=_route, chunk_bytes=4 * MiB, max_bytes=64 * MiB, timeout_s=30
            )
            pool_pb2_grpc.add_PoolServiceServicer_to_server(servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            channels = ChannelPool(options=OPTIONS)
            made.append(Replica(f"127.0.0.1:{port}", averager, channels, server))
        yield made
    finally:
        for r in made:
            await r.channels.close()
            await r.server.stop(None)
