"""A process's budget for the bodies of the requests it holds at once.

Every request a server receives declares its tensor bytes in its header (`swarm.wire.chunking`);
a server reserves them here before it allocates or accumulates a byte of the body, and gives them
back when the call is done with them. A call past the budget is refused at once (Busy on the data
plane, where another replica can take it; RESOURCE_EXHAUSTED elsewhere), never queued: however
many calls arrive, the bodies held stay within the budget, so no message, and no number of them,
sizes the process's memory.

A declaration costs its sender nothing: headers that declare the budget and never send a byte
would hold it for as long as the server waits for their bodies (issue 44, N6). A server that can
(the pool's `Reduce`) checks a declared body against what is free now (`Held.expect`) and holds
its bytes only as they arrive (`Held.arriving`): what a call holds is what it sent.

Used from one event loop: no locking.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from types import TracebackType
from typing import Any, TypeVar

from google.protobuf.message import Message

from swarm.errors import ConfigError, ResourceExhausted
from swarm.proto.framing import Framed
from swarm.wire.chunking import TENSOR_OVERHEAD_BYTES

M = TypeVar("M")

__all__ = ["Held", "ReceiveBudget"]


class ReceiveBudget:
    """At most `max_bytes` bytes of request bodies held at once; `flag` names the setting in
    refusals (how an operator raises it)."""

    def __init__(self, max_bytes: int, flag: str = "--receive-budget-bytes") -> None:
        if max_bytes <= 0:
            raise ConfigError(f"{flag} must be positive, got {max_bytes}")
        self.max_bytes, self.flag = max_bytes, flag
        self.in_use = 0  # bytes reserved now, by every call together

    def hold(self, refuse: type[ResourceExhausted] = ResourceExhausted) -> Held:
        """A call's reservations, given back together when it ends (`with budget.hold() as h`);
        a reservation past the budget raises `refuse`."""
        return Held(self, refuse)


class Held:
    """The bytes one call holds of a `ReceiveBudget`."""

    def __init__(self, budget: ReceiveBudget, refuse: type[ResourceExhausted]) -> None:
        self._budget, self._refuse = budget, refuse
        self.nbytes = 0
        self._declared: int | None = None  # the body `expect`ed, once its header is read

    def reserve(self, nbytes: int) -> None:
        """Take `nbytes` more for this call, or raise before anything is held for them."""
        budget = self._budget
        if nbytes > budget.max_bytes - budget.in_use:
            raise self._refusal(nbytes, "more")
        budget.in_use += nbytes
        self.nbytes += nbytes

    def charge(self, nbytes: int) -> None:
        """Hold `nbytes` more for this call whatever is free: bytes made already (a reply on its
        way out), counted so that the calls after them are refused while they are held."""
        self._budget.in_use += nbytes
        self.nbytes += nbytes

    def expect(self, nbytes: int) -> None:
        """A body of `nbytes` in all (with what this call holds already) is declared: refused
        now when it would not fit beside what every call holds, but nothing more is held for it
        until it comes (`arriving`)."""
        budget = self._budget
        if nbytes - self.nbytes > budget.max_bytes - budget.in_use:
            raise self._refusal(nbytes, "declared")
        self._declared = nbytes

    def _refusal(self, nbytes: int, what: str) -> ResourceExhausted:
        budget = self._budget
        return self._refuse(
            f"{nbytes} bytes {what}, but {budget.in_use} of this process's {budget.max_bytes} "
            f"bytes for received bodies are in use ({budget.flag}); try again later or elsewhere"
        )

    async def arriving(self, stream: AsyncIterable[M]) -> AsyncIterator[M]:
        """`stream`'s messages, each one's bytes reserved as it comes (past the budget the
        call is refused, the bytes it sent before given back when it ends): a header its
        encoded size and `TENSOR_OVERHEAD_BYTES` a tensor (what `receive` charges it beyond
        its inline data), a chunk its data. Once a body is `expect`ed, the call holds at most
        what it declared (its header's few bytes of fields are not charged twice)."""
        async for message in stream:
            nbytes = _arrived(message)
            if self._declared is not None:
                nbytes = min(nbytes, max(self._declared - self.nbytes, 0))
            self.reserve(nbytes)
            yield message
            # Not held here while the next is awaited (as `chunking.within_deadline`).
            del message

    def release(self) -> None:
        """Give back everything this call holds (twice is harmless)."""
        self._budget.in_use -= self.nbytes
        self.nbytes = 0

    def __enter__(self) -> Held:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _arrived(message: Any) -> int:
    """The bytes `message` brought: a message's encoded size (a header's inline data and a few
    bytes of fields, computed without a copy) and each tensor's overhead, or a `Framed`
    chunk's data. Anything else (a header refused unparsed, a message gRPC could not read) is
    passed on uncharged, for `receive` to refuse."""
    if isinstance(message, Message):
        return message.ByteSize() + TENSOR_OVERHEAD_BYTES * len(getattr(message, "tensors", ()))
    if isinstance(message, Framed):
        return len(message.data)
    return 0
