"""`swarm.deadline.within` keeps a cancellation that Python 3.11's `asyncio.wait_for` loses, and
the service's code waits with it, never with `wait_for`; `cancel_kept` raises the cancellation a
library's own `wait_for` lost (aiomqtt's)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
from collections.abc import Awaitable
from pathlib import Path

from swarm.deadline import cancel_kept, within

ROOT = Path(__file__).resolve().parents[1]
SERVICE = ("swarm", "stage_server", "scheduler", "client", "tests/support")
WAIT_FOR = re.compile(r"\basyncio\.wait_for\(|\bfrom asyncio import .*\bwait_for\b")


async def _cancelled_as_woken(wait: object) -> asyncio.Task[None]:
    """A loop waiting on an event through `wait` (`wait(event.wait(), timeout)`), cancelled
    after a set() woke its wait but before the waiter resumed: the window 3.11's `wait_for`
    loses the cancellation in."""
    woken = asyncio.Event()

    async def loop() -> None:
        while True:
            await wait(woken.wait(), 5.0)  # type: ignore[operator]
            woken.clear()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)  # it waits now
    woken.set()
    await asyncio.sleep(0)  # the wait finished; its waker has not run yet
    task.cancel()
    await asyncio.wait([task], timeout=1.0)
    return task


async def test_within_keeps_a_cancellation_that_comes_as_the_wait_ends() -> None:
    task = await _cancelled_as_woken(within)
    assert task.done() and task.cancelled()


async def _library_wait(awaitable: Awaitable[None], timeout_s: float) -> None:
    """A library's wait (aiomqtt's `_wait_for`), made with the `wait_for` of the Python it runs
    on: on 3.11 it loses the cancellation in `_cancelled_as_woken`'s window."""
    await asyncio.wait_for(awaitable, timeout_s)  # the service never calls it


async def test_cancel_kept_raises_what_a_library_wait_lost() -> None:
    task = await _cancelled_as_woken(lambda aw, t: cancel_kept(_library_wait(aw, t)))
    assert task.done() and task.cancelled()


async def test_cancel_kept_raises_what_a_library_wait_lost_to_a_failure() -> None:
    """The awaited thing failed as the cancellation came: `wait_for` raises the failure."""
    failing: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(cancel_kept(_library_wait(failing, 5.0)))
    await asyncio.sleep(0)  # it waits now
    failing.set_exception(ConnectionError("the broker went away"))
    await asyncio.sleep(0)  # the wait finished; its waker has not run yet
    task.cancel()
    await asyncio.wait([task], timeout=1.0)
    assert task.done() and task.cancelled()


async def test_cancel_kept_lets_a_cleanup_after_a_cancellation_go_on() -> None:
    async def clean_up() -> str:
        with contextlib.suppress(asyncio.CancelledError):  # handled: its cleanup follows
            await asyncio.sleep(5.0)
        return await cancel_kept(within(asyncio.sleep(0, "cleaned"), 1.0))

    task = asyncio.create_task(clean_up())
    await asyncio.sleep(0)
    task.cancel()
    assert await task == "cleaned"


async def test_cancel_kept_leaves_an_enclosing_timeout_a_timeout() -> None:
    """The timeout fires as a library's wait ends, in the window its `wait_for` swallows the
    timeout's cancellation in: raised again, the timeout's own, so it is a `TimeoutError`."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    scopes: list[asyncio.Timeout] = []

    async def bounded(wait: object) -> None:
        async with asyncio.timeout(None) as scope:
            scopes.append(scope)
            await wait(_library_wait(done, 5.0))  # type: ignore[operator]

    async def expired_as_it_ends(wait: object) -> asyncio.Task[None]:
        task = asyncio.create_task(bounded(wait))
        await asyncio.sleep(0)  # it waits now
        done.set_result(None)  # the wait's end and the timeout, in one turn of the loop
        scopes[-1].reschedule(loop.time())
        await asyncio.wait([task], timeout=1.0)
        return task

    task = await expired_as_it_ends(cancel_kept)
    assert task.done() and isinstance(task.exception(), TimeoutError)
    if sys.version_info < (3, 12):  # 3.12's `wait_for` keeps the cancellation itself
        # the control: without `cancel_kept` the library's `wait_for` returned, the timeout lost
        done, scopes = loop.create_future(), []
        lost = await expired_as_it_ends(lambda aw: aw)
        assert lost.done() and lost.exception() is None


async def test_within_bounds_the_wait() -> None:
    never = asyncio.Event()
    try:
        await within(never.wait(), 0.01)
    except TimeoutError:
        pass
    else:
        raise AssertionError("within returned without the event")
    done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    done.set_result("done")  # no bound at all is needed for what is already there
    assert await within(done, 0.0) == "done"


def test_the_service_never_waits_with_wait_for() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for top in SERVICE
        for path in sorted((ROOT / top).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if WAIT_FOR.search(line)
    ]
    assert not found, (
        "asyncio.wait_for loses a cancellation on Python 3.11 (swarm/deadline.py); use "
        "swarm.deadline.within:\n" + "\n".join(found)
    )
