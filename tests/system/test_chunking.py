"""Chunked streaming over a real gRPC echo in another process (slow). The round trips and every
receive error: tests/swarm/wire/test_chunking.py."""

from __future__ import annotations

import time

import pytest
import torch

from swarm.proto import stage_pb2, stage_pb2_grpc
from swarm.wire.chunking import decode_named, split
from swarm.wire.codec import encode
from tests.support.echo import (  # noqa: F401
    CHUNK_BYTES,
    GRPC_MAX_MESSAGE,
    LIMIT,
    OPTIONS,
    MiB,
    echo,
)


@pytest.mark.slow
async def test_grpc_echo_256_mib_bit_exact(stub: stage_pb2_grpc.StageServiceStub) -> None:
    n = 256 * MiB // 4
    # Random 32-bit words: every bit pattern, NaN payloads included, must survive.
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g).view(torch.float32)
    start = time.perf_counter()
    req = stage_pb2.StageForwardRequest(job="j", tensors=[encode(x, "inputs")])
    got = await echo(stub, split(req, CHUNK_BYTES))
    del req
    y = decode_named(got)["inputs"]
    elapsed = time.perf_counter() - start
    assert y.shape == x.shape and y.dtype == torch.float32
    assert torch.equal(y.view(torch.int32), x.view(torch.int32))
    print(f"256 MiB gRPC echo: {elapsed:.2f}s")
