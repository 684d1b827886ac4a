"""How every gRPC servicer in swarm answers a failed call, in one place.

A servicer method runs its body through `Servicing`: a swarm error with a status
(`swarm.rpc.status`)
is refused with that status and trailing metadata naming its class, so the client rebuilds the very
class (`from_rpc_error`) without reading the details; anything else is a bug: logged with its
traceback and answered INTERNAL, and the server keeps serving. `observe(method, code, seconds)`
sees every call (the stage server's request metrics).

A refused call lets go of its error's traceback (once logged) before it aborts. gRPC keeps the
abort's exception on the call's state, which the call's context holds, and the context is held
by the very frames the abort's traceback holds: a reference cycle, freed only when the garbage
collector next looks at old objects, which in a busy stage server can be minutes away. Had the
error kept its traceback, every frame it was raised through would sit in that cycle with all
they hold: a Push whose next hop failed held the replica's `StageRuntime` (its gradient sums,
its spill file) for as long, past the move that released it. The abort is also raised outside
the `except` block, so the error is not its implicit context."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NoReturn, TypeVar

import grpc

from swarm.errors import WireError
from swarm.net.told_ahead import refuse
from swarm.rpc.reader_idle import taken_within
from swarm.rpc.status import error_metadata, status_code

__all__ = ["SAID_CHARS", "Observe", "Servicing", "said"]

log = logging.getLogger(__name__)
T = TypeVar("T")
SAID_CHARS = 2000  # the most of a refusal's details said (`said`)

Observe = Callable[[str, str, float], None]
"""`(method, status code name, seconds)` of one finished call."""


class Servicing:
    """`name` starts every log line (a peer id, "scheduler", ...). `reader_idle_s`: a streamed
    answer whose reader takes no part for this long ends (`swarm.rpc.reader_idle`); None: the
    stream's own body bounds it."""

    def __init__(
        self, name: str, observe: Observe | None = None, reader_idle_s: float | None = None
    ) -> None:
        self.name, self._observe = name, observe
        self.reader_idle_s = reader_idle_s

    async def run(
        self, method: str, context: grpc.aio.ServicerContext, body: Callable[[], Awaitable[T]]
    ) -> T:
        """`await body()`, or the call aborted with the status its error means."""
        start = time.perf_counter()
        try:
            result = await body()
        except asyncio.CancelledError:
            self._done(method, grpc.StatusCode.CANCELLED, start)
            raise
        except Exception as e:
            failed = e
        else:
            self._done(method, grpc.StatusCode.OK, start)
            return result
        await self._abort(method, context, failed, start)  # outside `except`: the module says why

    async def stream(
        self, method: str, context: grpc.aio.ServicerContext, body: AsyncIterator[T]
    ) -> AsyncIterator[T]:
        """`body`'s messages; an error, even after some were sent, ends the call as in `run`."""
        start = time.perf_counter()
        failed: Exception | None = None
        try:
            async for message in body:
                if self.reader_idle_s is None:
                    yield message
                    continue
                with taken_within(self.reader_idle_s, f"{self.name} {method}"):
                    yield message
        except asyncio.CancelledError:
            self._done(method, grpc.StatusCode.CANCELLED, start)
            raise
        except Exception as e:
            failed = e
        if failed is not None:
            await self._abort(method, context, failed, start)  # outside `except`, as in `run`
        self._done(method, grpc.StatusCode.OK, start)

    def _refusal(self, method: str, error: Exception) -> tuple[grpc.StatusCode, str]:
        """The status and details `error` is answered with (logged here)."""
        code = status_code(error)
        if code is None and isinstance(error, WireError):
            code = grpc.StatusCode.INVALID_ARGUMENT  # a wire error of no particular kind
        if code is None:  # a bug, not bad input: report it, keep serving
            log.error("%s %s failed", self.name, method, exc_info=error)
            return grpc.StatusCode.INTERNAL, said(f"{type(error).__name__}: {error}")
        details = said(str(error))
        log.info("%s %s refused: %s: %s", self.name, method, code.name, details)
        return code, details

    async def _abort(
        self, method: str, context: grpc.aio.ServicerContext, error: Exception, start: float
    ) -> NoReturn:
        code, details = self._refusal(method, error)
        self._done(method, code, start)
        _drop_tracebacks(error)  # logged: its frames go now, not with gRPC's cycle (the module)
        # The metadata names the exact class: a client tells ActivationsNotCached from other
        # FAILED_PRECONDITIONs without matching the details. Told ahead too: a client still
        # writing its request reads it there (`swarm.net.told_ahead`).
        await refuse(context, code, details, error_metadata(error))

    def _done(self, method: str, code: grpc.StatusCode, start: float) -> None:
        if self._observe is not None:
            self._observe(method, code.name, time.perf_counter() - start)


def _drop_tracebacks(error: BaseException) -> None:
    """`error`'s traceback and those of the errors it was raised from or during, let go."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        todo += [e.__cause__, e.__context__]


def said(details: str, most: int = SAID_CHARS) -> str:
    """`details` as a refusal's log line and status say it: at most `most` characters (an
    error may echo a request's field whole: a 4 MB page token was a 16 MB log line per call,
    and a status over the caller's metadata limit)."""
    if len(details) <= most:
        return details
    return f"{details[:most]}... ({len(details)} characters)"
