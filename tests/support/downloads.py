"""What a joiner makes of a state download: the messages of a `DownloadState` reply decoded into
the state they carry, by the same receive a joiner's client does (`swarm.wire.chunking`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

import torch

from swarm.proto import stage_pb2 as pb
from swarm.wire import chunking as wire

__all__ = ["decoded_state"]


async def decoded_state(
    messages: Iterable[pb.StageDownloadStateResponse],
) -> dict[str, torch.Tensor]:
    """The tensors `messages` carry, by name (each received whole, its chunks joined)."""

    async def stream() -> AsyncIterator[pb.StageDownloadStateResponse]:
        for m in messages:
            yield m

    state: dict[str, torch.Tensor] = {}
    it = stream()
    while True:
        try:
            received = await wire.receive(it, max_bytes=1 << 30)
        except wire.EndOfStream:
            return state
        state.update(wire.decode_named(received, owned=True))
