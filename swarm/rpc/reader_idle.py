"""A server stream's reader that stops taking parts is let go (`taken_within`).

A gRPC answer streamed from an async generator hands each part to gRPC at its `yield`, and
gRPC's write then waits for the reader's flow control: a reader that stops reading, its
connection open, parks the generator there for as long as the connection lives, with all it
holds (a whole model being exported, an open file, a stage's updates, a place among a bounded
number of such answers). A generator cannot time its own `yield`, so a timer set as each part is
handed over cancels the call's task if the part is not taken in time; gRPC then ends the call
(its caller is told nothing: a cancelled handler sends no status, and the reader's own client
gives up at its own bound), and the generators are closed as they are let go."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

__all__ = ["READER_IDLE_S", "taken_within"]

log = logging.getLogger(__name__)

# A reader's bound where its service has no tighter one of its own (the job API's exports and
# fetches: a trainer, a CLI writing to its disk as it reads): long past any reader that reads.
READER_IDLE_S = 120.0


@contextlib.contextmanager
def taken_within(stall_s: float, said: str) -> Iterator[None]:
    """Around a server stream's `yield` of one part: the call's task is cancelled if its reader
    has not taken the part within `stall_s`, with `said` (what the reader held up) logged."""
    task = asyncio.current_task()
    assert task is not None  # a call's handler
    stalled = asyncio.get_running_loop().call_later(stall_s, _let_go, task, stall_s, said)
    try:
        yield
    finally:
        stalled.cancel()


def _let_go(task: asyncio.Task[object], stall_s: float, said: str) -> None:
    log.info("%s: its reader took no part for %.3g s: the call ends", said, stall_s)
    task.cancel()
