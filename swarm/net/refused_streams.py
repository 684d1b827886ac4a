"""A refused client stream is read, briefly, before its refusal is sent: its client then sees why.

grpc-aio clients (grpcio 1.85; grpc/grpc#36066) report a write that loses the race with the
server's early close as INTERNAL ("Internal error from Core"), overwriting the status the server
sent: a client that streams its request, then reads (`LoadState`, the data plane), is told
INTERNAL where it was refused (UNAUTHENTICATED, PERMISSION_DENIED), about once in a hundred
calls on an idle machine and more often under load. A server that reads the stream to the
client's half-close before it answers leaves no write to lose that race.

Reading costs the server a call slot and a message at a time, so it is bounded: in time, to
`at_once` calls at once (past it a refused call is answered unread: its client reads the
refusal told ahead, `swarm.net.told_ahead`), and, for a client that waits for a reply
mid-stream, by an idle pause (`idle_s`) that ends the read early. A stream refused part-way
(`after`) lets go of what was read before its refusal first."""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import AsyncIterable
from typing import Any

from swarm.deadline import within

__all__ = ["RefusedStreams"]


class RefusedStreams:
    """Reads the refused streams of one server: each for at most `total_s`, ended early by a
    pause of `idle_s` (None: read to the half-close or `total_s`), `at_once` at a time."""

    def __init__(self, *, total_s: float, idle_s: float | None, at_once: int) -> None:
        self.total_s, self.idle_s, self.at_once = total_s, idle_s, at_once
        self._reading = 0  # refused streams being read now

    @property
    def reading(self) -> int:
        """Refused streams being read now (at most `at_once`)."""
        return self._reading

    async def drain(self, requests: AsyncIterable[Any]) -> None:
        """Read and drop what the refused client still sends, until it half-closes, pauses for
        `idle_s` or `total_s` is up; at once when `at_once` streams are being read already."""
        if self._reading >= self.at_once:
            return
        self._reading += 1
        try:
            await self._read(requests)
        finally:
            self._reading -= 1

    async def after(self, refusal: BaseException, requests: AsyncIterable[Any]) -> None:
        """`drain`, for a stream refused part-way by `refusal`: the locals of the frames it was
        raised through (the messages read before it: a body's chunks, a state's tensors) are
        let go first, not held while the rest is read. Its traceback's lines stay."""
        traceback.clear_frames(refusal.__traceback__)  # all done but the one that caught it
        await self.drain(requests)

    async def _read(self, requests: AsyncIterable[Any]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.total_s
        it = requests.__aiter__()
        while (left := deadline - loop.time()) > 0:
            pause = left if self.idle_s is None else min(self.idle_s, left)
            try:
                await within(it.__anext__(), pause)
            except (StopAsyncIteration, TimeoutError):
                return
            except Exception:  # the stream broke (its client gone): nothing more to read, and
                return  # the refusal, not the read's failure, is what the call ends with
