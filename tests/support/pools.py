"""Real pool replicas for averaging tests: one gRPC server, `Averager` and `PoolServicer` each, on
127.0.0.1 port 0, serving job `JOB` stages 0 and 1; every replica's butterfly all-reduce at once
(`reduce_all`), and what its results must be (`assert_identical`, `ordered_sum`); a member made
to fail in its round (`fail_in_round`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import torch

from stage_server.averaging.butterfly import RoundSettings, all_reduce
from stage_server.averaging.channels import ChannelPool
from stage_server.averaging.owner import Averager
from stage_server.averaging.service import PoolServicer
from swarm.errors import NotFound
from swarm.proto import pool_pb2_grpc

__all__ = [
    "JOB",
    "OPTIONS",
    "MiB",
    "Replica",
    "assert_identical",
    "fail_in_round",
    "ordered_sum",
    "peer_ids",
    "reduce_all",
    "replicas",
]

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
async def replicas(
    n: int, scheduler_key: bytes | None = None, timeout_s: float = 30.0
) -> AsyncIterator[list[Replica]]:
    """`scheduler_key`: the key of the scheduler that placed them, whose round tickets their
    owners ask for (`swarm.net.round_tickets`); None: a pool its owner coordinates.
    `timeout_s`: their job's averaging timeout, each owner's bound on a round's part (a
    member's call of a far shorter deadline is its own: `Averager.reduce`)."""
    made: list[Replica] = []
    try:
        for peer in peer_ids(n):
            server = grpc.aio.server(options=OPTIONS)
            averager = Averager()
            servicer = PoolServicer(
                averager,
                route=_route,
                chunk_bytes=4 * MiB,
                max_bytes=64 * MiB,
                timeout_s=timeout_s,
                peer=peer,
                scheduler_key=lambda job: scheduler_key,
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


def peer_ids(n: int) -> list[str]:
    """The peer ids of `replicas(n)`'s owners, in group order (a round ticket names them)."""
    return [f"peer-{i}" for i in range(n)]


async def reduce_all(
    pool: Sequence[Replica], flats: Sequence[torch.Tensor], **kwargs: Any
) -> list[Any]:
    """Every replica's all_reduce, concurrently; results or exceptions in group order. `copies`:
    each replica's `ChunkCopies` (a fake device's), in group order; `on_sum`: each replica's
    (`all_reduce`'s), in group order; `proofs`: each member's `RoundPass`, in group order."""
    opts: dict[str, Any] = {
        "round": "r0",
        "job": JOB,
        "stage": 0,
        "timeout_s": 20.0,
        "chunk_bytes": 4 * MiB,
        "max_bytes": 64 * MiB,
    } | kwargs
    group = opts.pop("group", [r.address for r in pool])
    on_bytes = opts.pop("on_bytes", None)
    copies = opts.pop("copies", [None] * len(pool))  # each replica's device copies, or torch's
    on_sum = opts.pop("on_sum", [None] * len(pool))  # each replica's, in group order
    proofs = opts.pop("proofs", [None] * len(pool))  # each member's round ticket, in group order
    calls = [
        all_reduce(
            f,
            RoundSettings(group=group, index=i, proof=proofs[i], **opts),
            averager=r.averager,
            channels=r.channels,
            on_bytes=on_bytes,
            copies=c,
            on_sum=s,
        )
        for i, (r, f, c, s) in enumerate(zip(pool, flats, copies, on_sum, strict=True))
    ]
    return await asyncio.gather(*calls, return_exceptions=True)


def assert_identical(results: Sequence[Any]) -> torch.Tensor:
    """Every result the same bits (an exception among them is raised); returns the first."""
    for r in results:
        if isinstance(r, BaseException):
            raise r
    assert all(torch.equal(r, results[0]) for r in results[1:])
    return results[0]  # type: ignore[no-any-return]


def ordered_sum(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum in sender order (the owner's), as one addition after another."""
    total = values[0].clone()
    for v in values[1:]:
        total = total + v
    return total


def fail_in_round(
    monkeypatch: pytest.MonkeyPatch, averager: Averager, where: str, fail: Callable[[str], Any]
) -> None:
    """`averager`'s member calls `fail(where)` (which raises, or allocates what cannot be) in its
    next round: `where` "own part", as it makes its own contribution to the part it owns;
    "owner's sum", as it sums the part it owns."""
    if where == "own part":
        reduce = averager.reduce

        async def own_fails(round: Any, part: int, sender: int, *a: Any, **k: Any) -> Any:
            if sender == part:
                fail(where)
            return await reduce(round, part, sender, *a, **k)

        monkeypatch.setattr(averager, "reduce", own_fails)
    else:
        # Its averager's own summer only: a patch of the module's `_reduce` (as before) also
        # reached the other replicas' sums running meanwhile in this process, one run in about
        # five, and they failed instead of naming it.
        def sum_fails(*_: Any) -> Any:
            return fail(where)

        monkeypatch.setattr(averager, "summer", sum_fails)
