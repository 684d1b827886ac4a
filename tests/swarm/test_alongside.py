"""`swarm.alongside`: helpers beside a wait, a helper's error raised after all have ended, and a
cancellation of the caller never lost to it (Python 3.11's TaskGroup loses it: the control)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from swarm.alongside import alongside
from swarm.deadline import within
from swarm.errors import SwarmError

Runner = Callable[[Awaitable[Any], list[Coroutine[Any, Any, Any]]], Awaitable[None]]
WAIT_S = 5.0


async def _bare_group(until: Awaitable[Any], helpers: list[Coroutine[Any, Any, Any]]) -> None:
    """What the scheduler's job training did before: a TaskGroup, its first error unwrapped."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(helper) for helper in helpers]
            await until
            for task in tasks:
                task.cancel()
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from failed


async def _fails(what: str) -> None:
    """A helper that fails at its first turn (a peer gone)."""
    await asyncio.sleep(0)
    raise SwarmError(what)


async def _cancelled_while_winding_down(run: Runner) -> asyncio.Task[None]:
    """One helper fails (a peer gone) while another is busy with its cleanup, and the caller is
    cancelled then (a user's `swarm cancel`)."""
    winding, release = asyncio.Event(), asyncio.Event()

    async def cleans_up_slowly() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            winding.set()
            await release.wait()

    caller = asyncio.create_task(
        run(asyncio.Event().wait(), [_fails("peer gone"), cleans_up_slowly()])
    )
    await within(winding.wait(), WAIT_S)
    caller.cancel()
    await asyncio.sleep(0)
    release.set()
    await asyncio.wait([caller], timeout=WAIT_S)
    assert caller.done()
    return caller


async def test_the_bare_group_loses_the_cancellation() -> None:
    """The control: the window is hit, and 3.11's TaskGroup ranks the helper's error above it."""
    caller = await _cancelled_while_winding_down(_bare_group)
    assert not caller.cancelled()
    assert isinstance(caller.exception(), SwarmError)


async def test_a_cancellation_while_winding_down_after_an_error_is_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="swarm.alongside"):
        caller = await _cancelled_while_winding_down(alongside)
    assert caller.cancelled()
    assert "peer gone" in caplog.text  # the error is said, not raised


async def test_the_first_error_is_raised_after_every_helper_has_ended() -> None:
    cleaned: list[str] = []

    async def fails_later() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.append("later")
            raise SwarmError("second")  # in its cleanup: not the one raised

    async def to_the_end() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.append("trainer")

    with pytest.raises(SwarmError, match="first"):
        await within(
            alongside(asyncio.Event().wait(), [_fails("first"), fails_later()], [to_the_end()]),
            WAIT_S,
        )
    assert sorted(cleaned) == ["later", "trainer"]


async def test_helpers_are_cancelled_when_the_wait_ends_and_the_rest_run_to_their_end() -> None:
    finished = asyncio.Event()
    said: list[str] = []

    async def helper() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            said.append("helper cancelled")
            raise

    async def returns_early() -> None:
        said.append("returned")

    async def trainer() -> None:
        await finished.wait()
        await asyncio.sleep(0.01)  # past the wait's end: not cancelled for it
        said.append("trainer done")

    async def finish_soon() -> None:
        await asyncio.sleep(0.01)
        finished.set()

    asyncio.get_running_loop().create_task(finish_soon())
    await within(alongside(finished.wait(), [helper(), returns_early()], [trainer()]), WAIT_S)
    assert said == ["returned", "helper cancelled", "trainer done"]


async def test_the_waits_own_error_is_raised() -> None:
    async def broken() -> None:
        raise SwarmError("the wait broke")

    with pytest.raises(SwarmError, match="the wait broke"):
        await within(alongside(broken(), [asyncio.sleep(60)]), WAIT_S)


async def test_the_waits_error_beside_a_helpers_is_said_not_left_unretrieved(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A helper fails, and the wait fails too as the helpers wind down: the helper's error is
    raised, and the wait's was left in its task, for asyncio to log at some later collection
    ("Task exception was never retrieved", without context) or never. It is said with the
    rest now."""
    winding = asyncio.Event()

    async def wait_breaks_as_it_winds_down() -> None:
        await winding.wait()
        raise SwarmError("the wait broke")

    async def slow_cleanup() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            winding.set()
            await asyncio.sleep(0.05)  # the wait breaks meanwhile

    helpers = [_fails("peer gone"), slow_cleanup()]
    with (
        caplog.at_level(logging.WARNING, logger="swarm.alongside"),
        pytest.raises(SwarmError, match="peer gone"),
    ):
        await within(alongside(wait_breaks_as_it_winds_down(), helpers), WAIT_S)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["its wait failed too, as it wound down: SwarmError: the wait broke"], said
