"""A peer's take-up of a job (`stage_server.peer.take_up`): a stop ends it, whatever it is
doing, and nothing is taken up after the stop."""

from __future__ import annotations

import asyncio

from stage_server.peer.take_up import TakeUp
from swarm.deadline import within


async def _refuses() -> bool:
    return False  # measured and refused (its stages do not fit, say)


async def _takes() -> bool:
    await asyncio.sleep(60)  # a fetch of hours, say
    return True


async def test_a_stop_while_a_refused_take_up_turns_to_the_next_job_ends_it() -> None:
    """Refused, a take-up turns to the next job waiting (its spec parsed off the loop first):
    a stop meanwhile saw no take-up under way and returned, and the next job's take-up started
    after the peer had stopped (a review found it)."""
    taking = TakeUp()
    turning, parsed = asyncio.Event(), asyncio.Event()
    started: list[str] = []

    async def turn_to_the_next() -> None:
        turning.set()
        await parsed.wait()
        taking.start("next", _takes(), turn_to_the_next)
        started.append("next")

    taking.start("j", _refuses(), turn_to_the_next)
    await within(turning.wait(), 5.0)
    assert await taking.stop() is None  # nothing was being fetched or measured
    parsed.set()
    await asyncio.sleep(0.05)
    assert started == [] and not taking.busy


async def test_a_stop_ends_the_take_up_under_way_and_says_what_it_did() -> None:
    taking = TakeUp()
    taking.start("j", _takes(), _refused_never)
    taking.fetching = True
    await asyncio.sleep(0)
    assert taking.busy
    assert await taking.stop() == "fetching"
    assert not taking.busy


async def _refused_never() -> None:
    raise AssertionError("not refused")
