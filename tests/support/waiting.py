"""Waiting for something to become true: the one polled wait of the tests, on the event loop
(`wait_until`) or in a plain thread (`wait_until_blocking`, for tests that drive other
processes). Each returns the condition's first true answer, and fails naming what it awaited."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["What", "wait_until", "wait_until_blocking"]

T = TypeVar("T")


What = str | Callable[[], str]
"""What is awaited, said when it did not come: a text, or a function of what was last seen."""


def _failure(what: What, timeout_s: float, last: object) -> AssertionError:
    said = what if isinstance(what, str) else what()
    return AssertionError(f"not within {timeout_s:g} s: {said} (last answer: {last!r})")


async def wait_until(
    condition: Callable[[], T | None],
    what: What = "the condition",
    *,
    timeout_s: float = 30.0,
    every_s: float = 0.02,
) -> T:
    """`condition()`'s first true answer, asked every `every_s` on the running loop; an
    `AssertionError` naming `what` if none came within `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not (answer := condition()):
        if loop.time() >= deadline:
            raise _failure(what, timeout_s, answer)
        await asyncio.sleep(every_s)
    return answer


def wait_until_blocking(
    condition: Callable[[], T | None],
    what: What = "the condition",
    *,
    timeout_s: float = 120.0,
    every_s: float = 0.2,
) -> T:
    """`wait_until` for a test without a loop: the thread sleeps between the asks."""
    deadline = time.monotonic() + timeout_s
    while not (answer := condition()):
        if time.monotonic() >= deadline:
            raise _failure(what, timeout_s, answer)
        time.sleep(every_s)
    return answer
