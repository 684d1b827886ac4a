"""A stage server's own limits: what no job can raise.

A job's `[runtime]` is written by whoever submitted it, and a peer would defend itself with it
(`max_tensor_bytes = 10**15`, `chunk_bytes = 1`, `activation_cache = 10**9`); so each limit a
job names is clamped by the peer's (`stage_server.replica.messages.Limits`), and the limits no job
names (how many bytes of request bodies, of kept activations, calls, copying peers and state
downloads a process holds at once) are the peer's alone. Each is a `swarm stage-server` flag
(`--max-tensor-bytes`, ...), named in every refusal it causes. Pure data: the flags are parsed
without importing torch or gRPC.

The job's `[runtime]`, field by field. Clamped here: `chunk_bytes` (--min/--max-chunk-bytes),
`max_message_bytes` (--max-message-bytes: the gRPC messages it receives, from callers and from
the peers it calls), `max_tensor_bytes`, `activation_cache`, `max_queue`, `update_log_bytes`.
Not clamped, as no peer resource: `max_in_flight`, `lease_timeout_s`, `boundary_cache_bytes`
(the trainer's own), `max_commit_rounds` (the coordinator's patience), `data_plane` (a choice of
route, each call bounded as any other); and the deadlines `rpc_timeout_s`, `commit_timeout_s`,
`averaging_timeout_s`, which only bound how long a call or a pool round waits: what a waiting
call holds is within `--receive-budget-bytes` and `--max-concurrent-rpcs`, and the job's trainer
could hold a call that long anyway with a deadline of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from swarm.device.sharing import DEFAULT_CACHE_BYTES
from swarm.errors import ConfigError
from swarm.job.schema import GRPC_MAX_MESSAGE

__all__ = ["MESSAGE_HEADROOM", "PeerLimits", "flag_name"]

# Room in a message for a chunk's header: a message is at most a chunk and this.
MESSAGE_HEADROOM = 1 << 20


def _limit(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class PeerLimits:
    """A stage server's own limits; each field's flag is `--` and its name with dashes."""

    max_tensor_bytes: int = _limit(
        1 << 30, "largest tensor accepted, whatever the job says (bytes)"
    )
    min_chunk_bytes: int = _limit(64 << 10, "smallest chunk sent, whatever the job's chunk_bytes")
    max_chunk_bytes: int = _limit(16 << 20, "largest chunk sent, whatever the job's chunk_bytes")
    max_message_bytes: int = _limit(
        64 << 20,
        "largest gRPC message received or sent, whatever the job's max_message_bytes (bytes; at "
        "least --max-chunk-bytes + 1 MiB)",
    )
    max_update_log_bytes: int = _limit(
        4 << 30, "most bytes of updates kept for peers copying this one, whatever the job says"
    )
    max_activation_cache: int = _limit(
        1024, "most microbatches whose activations are kept, whatever the job's activation_cache"
    )
    max_activation_cache_bytes: int = _limit(
        DEFAULT_CACHE_BYTES,
        "most bytes of activations kept for Backwards (each microbatch's saved tensors; past it "
        "the oldest are dropped and their Backwards recompute); on CUDA, left at its default: "
        "an even part, between the servers on the card, of half the memory their windows may "
        "use; set by hand, kept (the servers on one card should add up to what it has free "
        "beside their stages' state), within the free memory read as each entry is kept",
    )
    max_queue: int = _limit(1024, "most pushed microbatches queued, whatever the job's max_queue")
    receive_budget_bytes: int = _limit(
        4 << 30, "request bodies this process holds at once; a call past it is busy (bytes)"
    )
    max_followers: int = _limit(4, "peers copying this one at once")
    follower_ttl_s: float = _limit(
        600.0, "a peer copying this one, unheard this long, is let go (s)"
    )
    max_state_downloads: int = _limit(4, "state downloads served at once")
    max_concurrent_rpcs: int = _limit(1024, "gRPC calls served at once; past it, refused")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (value >= 1 and math.isfinite(value)):
                raise ConfigError(f"{flag_name(f.name)} must be at least 1, got {value}")
        if self.min_chunk_bytes > self.max_chunk_bytes:
            raise ConfigError(
                f"--min-chunk-bytes {self.min_chunk_bytes} is above --max-chunk-bytes "
                f"{self.max_chunk_bytes}"
            )
        if not (
            self.max_chunk_bytes + MESSAGE_HEADROOM <= self.max_message_bytes <= GRPC_MAX_MESSAGE
        ):
            raise ConfigError(
                f"--max-message-bytes {self.max_message_bytes} must be at least --max-chunk-bytes "
                f"{self.max_chunk_bytes} + 1 MiB (a chunk and its header) and at most "
                f"{GRPC_MAX_MESSAGE}"
            )
        if self.receive_budget_bytes < self.max_tensor_bytes:
            raise ConfigError(
                f"--receive-budget-bytes {self.receive_budget_bytes} is below --max-tensor-bytes "
                f"{self.max_tensor_bytes}: a tensor this peer accepts could never be received"
            )


def flag_name(field: str) -> str:
    """`--max-tensor-bytes` for `max_tensor_bytes`."""
    return "--" + field.replace("_", "-")
