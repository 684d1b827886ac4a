"""Sweeping an ended job's retained topics off the broker.

Why: a retained message lives on the broker until someone clears it (an empty retained payload),
so without a sweep every job ever run would leave its announcement, its last step and an
assignment per peer it ever had, and days of jobs would grow the broker and every fresh
subscriber's backlog. Assignments go at once (an ended job needs no server), every one the
broker holds, an earlier run's to peers long gone too; the steps stay `retain_s` longer, of the
broker's holding them (a broker away holds nothing; the clear waits for it). The announcement,
by which a peer away across the end learns it, stays until newer jobs' ends push it out
(`scheduler.ended_announcements`).
The store keeps the job's record, which is what `swarm status` reads, so nothing is lost to it.
Finding what the broker holds is bounded: it waits for the burst of retained messages on a
fresh subscription to fall quiet, and no longer than a fixed timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from swarm.bus.connection import BusLike
from swarm.deadline import within

__all__ = ["clear_retained", "retained_on"]

log = logging.getLogger(__name__)

_SWEEP_QUIET_S = 0.5  # retained messages arrive at once: this long without one, none is left
_SWEEP_TIMEOUT_S = 10.0  # the longest a sweep of an ended job's retained topics takes
_HELD_CAP = 10  # an ended job's announcement is cleared within this many times its retain_s


async def clear_retained(
    bus: BusLike, job_id: str, retain_s: float, forget: Callable[[str], None]
) -> None:
    """Clear ended job `job_id`'s retained topics: its assignments at once, its steps after
    `retain_s` (its announcement stays, with the newest ended jobs':
    `scheduler.ended_announcements`); then `forget(job_id)` (what the scheduler still shows of
    the job). A broker that refuses is logged, not raised: the sweep goes on."""
    topics = bus.topics
    try:
        for topic in await retained_on(bus, topics.assign(job_id, "+")):
            await bus.publish(topic, b"", retain=True)
    except Exception:
        log.exception("job %s: retained assignments not cleared", job_id)
    await _held_for(bus, job_id, retain_s)
    try:
        await bus.publish(topics.steps(job_id), b"", retain=True)
    except Exception:
        log.exception("job %s: retained steps not cleared", job_id)
    forget(job_id)


async def _held_for(bus: BusLike, job_id: str, retain_s: float) -> None:
    """Wait until the broker has held the job's last retained messages `retain_s`: the bus's
    link up (`ready`, its retained messages restored) that long without a break seen. A message
    published while the broker was away is kept by the bus and sent when it is back; a clear
    published meanwhile replaced it there, and the broker never had it. Looked at every
    twentieth of `retain_s` (a shorter break may go unseen: the message is restored with the
    link all the same), and `_HELD_CAP` times `retain_s` at most: a bus that ended for good, or
    a link that never stays up that long, clears then."""
    ready = getattr(bus, "ready", None)
    if not isinstance(ready, asyncio.Event):  # a bus without a link to lose (a test's)
        await asyncio.sleep(retain_s)
        return
    loop = asyncio.get_running_loop()
    deadline, every = loop.time() + _HELD_CAP * retain_s, max(_SWEEP_QUIET_S, retain_s / 20)
    while (left := deadline - loop.time()) > 0:
        with contextlib.suppress(TimeoutError):
            await within(ready.wait(), left)
        up = loop.time()
        while ready.is_set() and (held := loop.time() - up) < retain_s:
            await asyncio.sleep(min(every, retain_s - held))
        if ready.is_set():
            return
    log.warning(
        "job %s: the broker did not stay reachable %.0f s in %.0f s: its announcement is "
        "cleared all the same",
        job_id,
        retain_s,
        _HELD_CAP * retain_s,
    )


async def retained_on(bus: BusLike, pattern: str) -> list[str]:
    """The topics the broker holds a retained message on, matching `pattern`: what arrives
    on a fresh subscription until it falls quiet (bounded)."""
    found: list[str] = []
    sub = bus.subscribe(pattern)
    try:
        subscribed = getattr(sub, "wait_subscribed", None)
        if subscribed is not None:
            await subscribed(_SWEEP_TIMEOUT_S)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _SWEEP_TIMEOUT_S
        while loop.time() < deadline:
            try:
                async with asyncio.timeout(_SWEEP_QUIET_S):
                    topic, _ = await anext(sub)
            except TimeoutError:
                break
            found.append(topic)
    finally:
        close = getattr(sub, "aclose", None)
        if close is not None:
            await close()
    return found
