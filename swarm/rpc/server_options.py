"""Every swarm gRPC server's transport limits, in one place: what a caller can hold of a server
before any handler, or the token check, sees its call.

gRPC holds a whole request message before a unary handler runs, and counts a call waiting for
its message against `maximum_concurrent_rpcs`; an HTTP/2 connection costs a descriptor whether
or not it ever carries a call. So each server bounds, below the handlers: the bytes of one
message it receives; the calls in progress; the calls (streams) on one connection; the
connections open at once (past it a new one is closed at once); how long a connection may sit
idle, live at all (then GOAWAY: a client reconnects transparently, calls in flight get a grace),
and take to finish its handshake. A caller without the token is refused at its header, before
its message is read (`swarm.net.tokens`), so what it holds is its stream's flow-control window
for the moment the refusal takes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import grpc
from prometheus_client import CollectorRegistry

from swarm.net.tokens import server_interceptors
from swarm.ops.rated import RatedLog

__all__ = ["REFUSAL_LOG_EVERY_S", "SCHEDULER_LIMITS", "ServerLimits", "grpc_server"]

MiB = 1 << 20
# One log line per refusal reason this often (`swarm_auth_refused_total` counts them all).
REFUSAL_LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class ServerLimits:
    max_receive_bytes: int  # one request message, held whole by gRPC before any check
    max_send_bytes: int  # one answer message
    max_concurrent_rpcs: int  # calls in progress; past it RESOURCE_EXHAUSTED at the header
    max_streams_per_connection: int = 256  # calls open at once on one connection
    # Open at once; past it a new one is closed at once. A descriptor each: the bound that keeps
    # a stranger from taking the process's descriptors, not from locking callers out, which it
    # can at any cap (it only needs more connections); that is the host firewall's, per source.
    max_connections: int = 512
    # A connection with no call this long gets GOAWAY. gRPC cannot tell a connection that never
    # carried an authenticated call, so this is how long a stranger's idle connections (the
    # HTTP/2 preface, nothing else) hold their places: short. A caller's channel reconnects at
    # its next call, transparently (swarm's clients set no keepalive that would fight it).
    idle_s: float = 30.0
    max_age_s: float = 7200.0  # any connection this old gets GOAWAY (gRPC adds ±10% jitter)
    # then its calls in flight have this long to finish; a call cut then is retried on a new
    # connection, which gives it max_age_s + age_grace_s (a long state download included)
    age_grace_s: float = 7200.0
    handshake_s: float = 20.0  # to finish the TLS and HTTP/2 handshake once connected

    def __post_init__(self) -> None:
        counts = [self.max_receive_bytes, self.max_send_bytes, self.max_concurrent_rpcs]
        counts += [self.max_streams_per_connection, self.max_connections]
        if min(counts) < 1:
            raise ValueError(f"{self}: every size and count must be at least 1")
        if not min(self.idle_s, self.max_age_s, self.age_grace_s, self.handshake_s) > 0:
            raise ValueError(f"{self}: every duration must be positive")

    def with_message_bytes(self, max_message_bytes: int) -> ServerLimits:
        return replace(self, max_receive_bytes=max_message_bytes, max_send_bytes=max_message_bytes)

    def options(self) -> list[tuple[str, int]]:
        """The `options=` of `grpc.aio.server`."""

        def ms(seconds: float) -> int:
            return max(1, round(seconds * 1000))

        return [
            ("grpc.max_receive_message_length", self.max_receive_bytes),
            ("grpc.max_send_message_length", self.max_send_bytes),
            ("grpc.max_concurrent_streams", self.max_streams_per_connection),
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.max_connection_idle_ms", ms(self.idle_s)),
            ("grpc.max_connection_age_ms", ms(self.max_age_s)),
            ("grpc.max_connection_age_grace_ms", ms(self.age_grace_s)),
            ("grpc.server_handshake_timeout_ms", ms(self.handshake_s)),
            ("grpc.so_reuseport", 0),  # a busy port must fail loudly, not be shared
        ]


# The job API: a job file is at most 1 MiB (MAX_SPEC_BYTES) and a lease report a few bytes a
# microbatch, so 4 MiB is room to spare; exports are sent in chunks of at most 64 MiB.
SCHEDULER_LIMITS = ServerLimits(
    max_receive_bytes=4 * MiB, max_send_bytes=64 * MiB, max_concurrent_rpcs=512
)


def grpc_server(
    limits: ServerLimits, *, token: str | None, registry: CollectorRegistry
) -> grpc.aio.Server:
    """A `grpc.aio` server within `limits` that refuses calls without `token` (None: open),
    counting them on `registry` and logging them rated."""
    refusals = RatedLog(logging.getLogger("swarm.net.tokens"), REFUSAL_LOG_EVERY_S)
    return grpc.aio.server(
        interceptors=server_interceptors(token, registry, refusals),
        options=limits.options(),
        maximum_concurrent_rpcs=limits.max_concurrent_rpcs,
    )
