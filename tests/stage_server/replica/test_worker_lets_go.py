"""A replica's worker lets go of a call (its function, its arguments) before its caller wakes.

CI saw `test_released_stage` find a released replica's runtime still held: the worker thread that
had run the refused PREPARE was still inside `set_exception`, waking the event loop, when the
loop had already answered the refusal, released the stage and looked. Its frame held the call's
closure, and through it the function that held the runtime. The caller must find nothing of its
call held by the worker once it has the outcome, whichever thread the scheduler runs first.

Here the call runs only once its caller waits on it (`asyncio.wrap_future` has chained its
future), and the worker thread is held right after it has woken the loop (the loop's
`call_soon_threadsafe` blocks on a gate once it has queued the wake-up) until the caller has
looked: the ordering CI hit one run in ~30, every run."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest

from stage_server.replica.worker import Worker
from tests.support.collector import collector_off


class Payload:
    """What a call's arguments hold (a stage's runtime, in the replica)."""


class Refused(Exception):
    pass


class Call:
    """The call the worker runs, once its caller waits on it (`waited`)."""

    def __init__(self, refused: bool) -> None:
        self.refused, self.waited = refused, threading.Event()

    def __call__(self, payload: Payload) -> int:
        assert self.waited.wait(10), "the caller never waited on its call"
        if self.refused:
            raise Refused("receipts missing")
        return 1


@contextmanager
def _caller_waiting(monkeypatch: pytest.MonkeyPatch, call: Call) -> Iterator[None]:
    """`call.waited` is set once the worker's caller has chained the call's future."""
    original = asyncio.wrap_future

    def chained(future: Any, **kwargs: Any) -> Any:
        waiting = original(future, **kwargs)
        call.waited.set()
        return waiting

    with monkeypatch.context() as patch:
        patch.setattr(asyncio, "wrap_future", chained)
        yield


@contextmanager
def _worker_held_after_waking(loop: asyncio.AbstractEventLoop) -> Iterator[threading.Event]:
    """The worker thread, once it has queued the loop's wake-up, waits for the gate: the caller
    runs (and looks) while the worker thread is still in its hand-back."""
    gate = threading.Event()
    loop_thread = threading.get_ident()
    original = loop.call_soon_threadsafe

    def held(callback: Callable[..., Any], *args: Any, context: Any = None) -> asyncio.Handle:
        handle = original(callback, *args, context=context)
        if threading.get_ident() != loop_thread:
            gate.wait(10)
        return handle

    loop.call_soon_threadsafe = held  # type: ignore[method-assign]
    try:
        yield gate
    finally:
        gate.set()
        del loop.call_soon_threadsafe


async def _looked(refused: bool, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What of its call is still held when the caller has its outcome: [] or ["arguments"]."""
    executor = ThreadPoolExecutor(1)
    worker = Worker(executor, lambda _: None)
    payload = Payload()
    ref = weakref.ref(payload)
    call = Call(refused)
    loop = asyncio.get_running_loop()
    try:
        with collector_off(), _caller_waiting(monkeypatch, call), _worker_held_after_waking(loop):
            if refused:
                try:
                    await worker.run(call, payload)
                except Refused as e:
                    e.__traceback__ = None  # as a refused call's is once logged (servicing)
                else:
                    pytest.fail("the call was not refused")
            else:
                assert await worker.run(call, payload) == 1
            del payload
            return ["arguments"] if ref() is not None else []
    finally:
        executor.shutdown(wait=True)


@pytest.mark.parametrize("refused", [True, False], ids=["refused", "answered"])
async def test_the_worker_holds_nothing_of_a_call_once_its_caller_has_the_outcome(
    refused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert await _looked(refused, monkeypatch) == []
