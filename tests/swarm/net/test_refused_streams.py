"""A stream refused part-way is read with nothing of what came before its refusal held
(`RefusedStreams.after`): the frames the refusal was raised through let go of their locals."""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator

import torch

from swarm.errors import InvalidArgument
from swarm.net.refused_streams import RefusedStreams


async def _take(parts: list[torch.Tensor]) -> None:
    """Keeps what it took in its frame, as a receive does, and refuses part-way."""
    taken = [parts.pop()]
    raise InvalidArgument(f"refused after {len(taken)} part")


async def test_what_was_read_before_a_refusal_is_let_go_before_the_rest_is_read() -> None:
    parts = [torch.zeros(1024)]
    gone = weakref.ref(parts[0])
    alive_while_read: list[bool] = []

    async def rest() -> AsyncIterator[int]:
        alive_while_read.append(gone() is not None)
        yield 1

    try:
        await _take(parts)
    except InvalidArgument as refused:
        assert gone() is not None  # held by the refusal's frames until now
        await RefusedStreams(total_s=5.0, idle_s=None, at_once=1).after(refused, rest())
        assert refused.__traceback__ is not None  # its lines stay, for the log
    assert alive_while_read == [False]


async def test_a_stream_that_breaks_while_read_ends_the_read_not_the_refusal() -> None:
    # A client gone mid-read: the refused call still ends with its refusal, not the read's error.
    async def broken() -> AsyncIterator[int]:
        yield 1
        raise ConnectionResetError("the client went away")

    refusal = InvalidArgument("refused")
    await RefusedStreams(total_s=5.0, idle_s=None, at_once=1).after(refusal, broken())
