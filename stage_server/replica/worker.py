"""A replica's worker: the one thread its torch work runs on, how many calls wait for it, and how
long one takes.

Torch work is serial per replica: one thread, so a stage's parameters, gradient sums and caches are
never touched by two calls at once (`StageRuntime` takes no locks), and the event loop stays free
to move the bytes of the calls queued behind it. The calls queued or running here are the load
the peer reports (`waiting`); `ema_seconds` is the service time its load reports divide by, the
time a call holds the worker and never its wait in the queue (`run_queued` returns that wait
separately, so a trainer's estimate of this replica is its speed, not its backlog).

Every time here is the device's (`swarm.device.compute_clock`): a call holds the worker
until the device has finished its work, not until its launch returned, so on CUDA the service time,
the queue's waits and the queue depth are the compute's, whichever stage reads its results back.

A call's results reach the event loop on the host: `run_then`'s `after` (the copy of the reply to
the host, `swarm.device.host_copies`) runs on the worker thread once the compute has
settled, outside its timing, so the loop never waits on the device.

`throttle` > 1 stands in for a slower device: the worker is held that much longer after each call,
as a slower device would hold it, and the EMA sees the held time.

Calls run in turn, except the re-execution of an audit that gates its microbatch's report
(`first`, `run_ahead`): it runs before every call still queued (issue 69), but a call in turn
that waits runs once `AHEAD_IN_A_ROW` have run ahead since the last in turn (an honest
re-execution then waits one push at most). Such a step waits for
its microbatches' audits before it commits, and a re-execution queued behind an auditor's pushes
made the step wait for them too; ahead of them it costs those pushes its own compute only. A late
audit's (`stage_server.replica.answering`) runs in turn: its bound is a step away. Among the calls
asked `first`, and among the others, the order is the order they came in.

The worker thread lets go of a call (its function, its arguments) before it wakes the call's
caller: the thread is still waking the loop when the caller may already have gone on, released
its stage (`Servicer.release`) and found its runtime held by that thread's frame.

A stopping stage server `close`s its worker before it shuts the executor down: gRPC's stop returns
once its core holds no live call, not once every handler has ended, so a Push whose request was
read just before may reach the worker only then. It is refused (`PeerUnavailable`: UNAVAILABLE,
what a stopping server answers; its call is over anyway), not submitted to an executor shut down,
which raised a RuntimeError that was logged as an ERROR.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

from swarm.device.compute_clock import HOST_CLOCK, ComputeClock
from swarm.errors import PeerUnavailable
from swarm.ops import timeline

__all__ = ["AHEAD_IN_A_ROW", "LOAD_EMA", "Worker"]

T = TypeVar("T")
U = TypeVar("U")
LOAD_EMA = 0.2  # weight of the newest call in the reported moving average
# Calls run ahead in a row while a call in turn waits: then it runs. A re-execution is asked
# ahead by whoever calls a Forward on the push plane (any token holder, `Answering.redoes`): a
# stream of them held every push back for as long as it went on. An honest step's audits are
# a few microbatches, each past one push at most.
AHEAD_IN_A_ROW = 1


class Worker:
    """Runs calls on `executor` (a single-thread pool); `on_queue(+1/-1)` sees each call enter and
    leave (the stage's queue-depth metric); `clock` times them (the served device's: `serve`
    sets it)."""

    def __init__(
        self,
        executor: Executor,
        on_queue: Callable[[int], None],
        throttle: float = 1.0,
        clock: ComputeClock = HOST_CLOCK,
    ) -> None:
        self.executor, self._on_queue, self.clock = executor, on_queue, clock
        self.throttle = throttle  # >1: each call holds the worker that many times as long
        self.waiting = 0  # calls queued or running: the load this peer reports
        self.ema_seconds: float | None = None  # moving average of one call (seconds)
        self.closed = False  # the server is stopping: new calls are refused (`close`)
        # The calls submitted, not started yet: (0 ahead / 1 in turn, arrival, run, its future).
        # The executor gets one `_next` per call, which runs whichever comes first then.
        self._queued: list[tuple[int, int, Callable[[], None], concurrent.futures.Future[Any]]] = []
        self._arrivals = itertools.count()
        self._ahead_in_a_row = 0  # calls run ahead since the last in turn (`AHEAD_IN_A_ROW`)
        self._lock = threading.Lock()  # the loop queues, the worker thread takes

    def close(self) -> None:
        """Refuse every call from now on (the server stops; its executor is shut down next)."""
        self.closed = True

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the worker thread."""
        result, _ = await self.run_queued(fn, *args, **kwargs)
        return result

    async def run_queued(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, float]:
        """`run`, also returning how long the call waited for the worker (seconds)."""
        return await self.run_then(fn, _itself, *args, **kwargs)

    async def run_then(
        self, fn: Callable[..., T], after: Callable[[T], U], *args: Any, **kwargs: Any
    ) -> tuple[U, float]:
        """`run_queued`, then `after(result)` on the worker thread before the loop gets it:
        what must wait on the device (its results' copy to the host) waits there. `after` is not
        part of the call's service time (`ema_seconds`), which is the compute's."""
        return await self._run(False, fn, after, *args, **kwargs)

    async def run_ahead(
        self, fn: Callable[..., T], after: Callable[[T], U], *args: Any, **kwargs: Any
    ) -> tuple[U, float]:
        """`run_then`, before every call queued in turn (the re-execution of an audit that gates
        its microbatch's report: the module's docstring)."""
        return await self._run(True, fn, after, *args, **kwargs)

    async def _run(
        self, ahead: bool, fn: Callable[..., T], after: Callable[[T], U], *args: Any, **kwargs: Any
    ) -> tuple[U, float]:
        if self.closed:
            raise PeerUnavailable("the stage server is stopping: the call was not run")
        self._on_queue(1)
        self.waiting += 1
        clock = self.clock  # one clock for both ends of the wait
        submitted = clock.now()
        started: list[float] = []

        def timed() -> U:
            started.append(clock.now())
            result = self._throttled(functools.partial(fn, *args, **kwargs), clock)
            if not timeline.enabled():
                return after(result)
            settled = clock.now()
            out = after(result)
            # queued, computed until the device settled, then its results to the host (`after`)
            timeline.span(
                "compute",
                started[0],
                settled,
                fn=_name(fn),
                q=submitted,
                t2=clock.now(),
                at=_microbatch(args),
                **({"ahead": True} if ahead else {}),
            )
            return out

        call: concurrent.futures.Future[U] = concurrent.futures.Future()
        # `run` reaches the call through this list, which it empties before it hands the outcome
        # over: the worker thread is still inside `set_result`/`set_exception` (waking the loop)
        # when the caller may already have gone on, released its stage and looked, and a
        # closure over `timed` there would still hold the call's function and arguments (the
        # runtime: the module's docstring).
        work = [timed]

        def run() -> None:
            job = work.pop()
            if not call.set_running_or_notify_cancel():
                return  # its caller gave up while it was queued
            try:
                outcome = job()
            except BaseException as e:  # as the executor's own work items: the caller's to see
                del job
                call.set_exception(e)
            else:
                del job
                call.set_result(outcome)

        try:
            queued = (0 if ahead else 1, next(self._arrivals), run, call)
            with self._lock:
                heapq.heappush(self._queued, queued)
            try:
                turn = asyncio.get_running_loop().run_in_executor(self.executor, self._next)
            except BaseException:  # the executor refused it (shut down): no turn, no call
                with self._lock:
                    self._queued.remove(queued)
                    heapq.heapify(self._queued)
                raise
            turn.add_done_callback(self._turn_ended)
            result = await asyncio.wrap_future(call)
            return result, started[0] - submitted
        finally:
            self._on_queue(-1)
            self.waiting -= 1

    def _next(self) -> None:
        """On the worker thread, once for each call submitted: the call that comes first now,
        but the first call in turn waiting once `AHEAD_IN_A_ROW` have run ahead since the last
        in turn."""
        with self._lock:
            queued = self._queued
            first = queued[0]
            if first[0] == 0 and self._ahead_in_a_row >= AHEAD_IN_A_ROW:
                in_turn = [q for q in queued if q[0] == 1]
                if in_turn:
                    first = min(in_turn)
            queued.remove(first)
            heapq.heapify(queued)
            self._ahead_in_a_row = self._ahead_in_a_row + 1 if first[0] == 0 else 0
        first[2]()

    def _turn_ended(self, turn: asyncio.Future[None]) -> None:
        """A turn the executor cancelled (shut down with calls pending) runs no call: one call
        queued is cancelled for it, so its caller is told (as the executor's own cancel told it)
        rather than left waiting for a turn that never comes."""
        if not turn.cancelled():
            return
        with self._lock:
            dropped = heapq.heappop(self._queued)[3] if self._queued else None
        if dropped is not None:
            dropped.cancel()

    def _throttled(self, call: Callable[[], T], clock: ComputeClock) -> T:
        start, failed = clock.now(), True
        try:
            result = call()
            failed = False
            return result
        finally:
            # Until the device has run what the call launched: the worker is not free before
            # (the next call's work would queue behind it), and a call that failed still held it.
            try:
                clock.settle()
            except Exception:
                if not failed:  # a device error surfacing now: the call's result is not to be had
                    raise
                # else the call's own error is the one to tell (the device's is likely its echo)
            if self.throttle > 1:  # hold the worker, as a slower device would be held
                time.sleep((self.throttle - 1) * (clock.now() - start))
            seconds = clock.now() - start
            self.ema_seconds = (
                seconds
                if self.ema_seconds is None
                else (LOAD_EMA * seconds + (1 - LOAD_EMA) * self.ema_seconds)
            )


def _itself(result: T) -> T:
    return result


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _microbatch(args: tuple[Any, ...]) -> list[int] | None:
    """(step, index) where a call's first arguments are those (forward, backward, ...)."""
    if len(args) >= 2 and all(type(a) is int for a in args[:2]):
        return [args[0], args[1]]
    return None
