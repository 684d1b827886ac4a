"""A lossy body widened on a thread (`decode_named_async`, `decode_async`) is its caller's until
the thread ends: a caller cancelled meanwhile (its client hung up) returns only once the decode
did. A thread cannot be stopped, and the caller gives its budget reservation back as it returns:
before, it returned at once, and the thread went on widening up to a microbatch outside the
receive budget (one per thread of the default executor)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from swarm.proto import stage_pb2, tensor_pb2
from swarm.wire import chunking
from swarm.wire.chunking import OFF_LOOP_VALUES, Received, decode_async, decode_named_async
from swarm.wire.codec import CODEC_FP16, encode

pytestmark = pytest.mark.timeout(60)


def _lossy() -> tensor_pb2.Tensor:
    """A tensor whose widening is work enough to go to a thread."""
    return encode(torch.zeros(OFF_LOOP_VALUES), "x", CODEC_FP16)


def _blocking(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> tuple[threading.Event, threading.Event]:
    """Make chunking's `name` block on a thread until released: (started, release)."""
    started, release = threading.Event(), threading.Event()
    real = getattr(chunking, name)

    def blocked(*args: Any, **kwargs: Any) -> Any:
        started.set()
        assert release.wait(20), "never released"
        return real(*args, **kwargs)

    monkeypatch.setattr(chunking, name, blocked)
    return started, release


async def _cancelled_while_decoding(
    decoding: Any, started: threading.Event, release: threading.Event
) -> list[bool]:
    """Cancel a caller of `decoding()` while its thread decodes; whether the decode had ended
    each time the caller returned (as it gives its reservation back)."""
    returned: list[bool] = []

    async def caller() -> None:
        try:
            await decoding()
        finally:
            returned.append(release.is_set())

    task = asyncio.create_task(caller())
    assert await asyncio.to_thread(started.wait, 10)
    for _ in range(2):  # cancelled again while it waits: it still waits
        task.cancel()
        await asyncio.sleep(0.1)
        assert not task.done(), "the caller returned while its decode still ran"
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    return returned


async def test_a_cancelled_named_decode_returns_once_its_thread_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started, release = _blocking(monkeypatch, "_decoded")
    header = stage_pb2.StageForwardRequest(tensors=[_lossy()])
    received = Received(header, [bytes(header.tensors[0].data)])
    reserved: list[int] = []
    returned = await _cancelled_while_decoding(
        lambda: decode_named_async(received, reserve=reserved.append), started, release
    )
    assert returned == [True] and reserved == [4 * OFF_LOOP_VALUES]


async def test_a_cancelled_decode_returns_once_its_thread_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started, release = _blocking(monkeypatch, "decode")
    returned = await _cancelled_while_decoding(lambda: decode_async(_lossy()), started, release)
    assert returned == [True]


async def test_a_decode_that_fails_on_its_thread_fails_its_caller() -> None:
    broken = _lossy()
    broken.data = broken.data[:-2]  # two bytes short of its shape
    with pytest.raises(Exception, match="bytes"):
        await decode_async(broken)


async def test_a_decode_still_queued_when_its_caller_is_cancelled_never_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The executor's one thread is busy: the decode waits in its queue. Cancelled there, its
    # caller returns at once, and the decode is never run (nothing of it is widened).
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(max_workers=1)
    loop.set_default_executor(executor)
    busy = threading.Event()
    occupied = loop.run_in_executor(executor, busy.wait, 20)
    ran: list[bool] = []
    real = chunking.decode
    monkeypatch.setattr(chunking, "decode", lambda *a, **k: ran.append(True) or real(*a, **k))
    task = asyncio.create_task(decode_async(_lossy()))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    busy.set()
    await occupied
    await loop.run_in_executor(executor, lambda: None)  # the queued call came and went
    assert ran == []
