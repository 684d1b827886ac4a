"""Calls to replicas that last only while the peer registry lists their replica: `while_listed`.

A PREPARE waits up to `runtime.commit_timeout_s` (2 minutes by default) for a replica that is
averaging. A replica that hangs with the call in flight (SIGSTOPped, its host frozen) keeps its
connections open, so the call neither fails nor answers: it waits out that whole deadline, and
so does the step, although the registry left the replica out seconds after its load reports
stopped. Had it been left out before the call, the attempt would have gone on without it; so it
does once it is left out during the call: the call is cancelled and counts as the replica gone
(`PeerUnavailable`: the attempt drops it and its microbatches are replayed on the others).

A left-out replica's round partners cannot end their round without it either: each waits for
its parts until the round's averaging timeout (a minute by default; a replica moved to another
stage mid-PREPARE, or a hung one, never sends them). So their calls are called off with it
(`pools`: the round each call averages in), each an `Aborted` naming it, and the retry goes
without it at once.

The registry is pure state, asked and never telling (`scheduler.registry`: a peer's silence is
judged when its members are asked), so the calls' replicas are looked for in it every
`LISTED_EVERY_S` while any call is in flight: one registry look per quarter second of a commit,
none for a commit that ends sooner.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from swarm.errors import Aborted, PeerUnavailable
from swarm.rpc.lease import Replica

__all__ = ["LISTED_EVERY_S", "listed_as", "while_listed"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How often the registry is asked, while calls are in flight, whether it still lists their
#: replicas: a hung replica is waited for at most this long after the registry leaves it out.
LISTED_EVERY_S = 0.25


async def while_listed(
    members: Callable[[], list[list[Replica]]],
    calls: Sequence[tuple[int, Replica, Awaitable[T]]],
    what: str,
    every_s: float = LISTED_EVERY_S,
    *,
    pools: Sequence[Sequence[str]] = (),
) -> list[T | BaseException]:
    """Each of `calls` ((stage, replica, call)) at once, their outcomes in order as
    `asyncio.gather(..., return_exceptions=True)` gives them; but a call whose replica
    `members()` (the registry's, per stage) no longer lists at its stage is cancelled and its
    outcome is `PeerUnavailable`, saying why (`what`: the call, in words, for the log). So is
    every call of the same stage whose round (`pools[i]`: the addresses call i averages with,
    itself included; none given: no rounds) holds that replica's address, its outcome `Aborted`
    naming the replica's place in the round, unless it is left out itself (at that look or a
    later one: then `PeerUnavailable`, as it is gone). A cancellation of the caller cancels
    every call, as gather's does."""
    tasks = [asyncio.ensure_future(call) for _, _, call in calls]
    pending: set[asyncio.Future[T]] = set(tasks)
    left: dict[int, Exception] = {}  # index -> why its call was not waited for

    def give_up(index: int, why: Exception) -> None:
        left[index] = why
        tasks[index].cancel()
        tasks[index].add_done_callback(_retrieve)  # nobody awaits it: its ending is not news
        pending.discard(tasks[index])

    try:
        while pending:
            _, pending = await asyncio.wait(pending, timeout=every_s)
            if not pending:
                break
            listed = members()
            # Every replica left out at this look is gone, a partner called off before too: a
            # home outage takes a round's members together, and each is dropped as gone.
            gone = [
                index
                for index, (stage, replica, _) in enumerate(calls)
                if not isinstance(left.get(index), PeerUnavailable)
                and (index in left or not tasks[index].done())
                and not _listed(listed, stage, replica)
            ]
            for index in gone:
                stage, replica, _ = calls[index]
                give_up(index, _left_out(stage, replica, what))
                log.warning("%s", left[index])
            for index in gone:  # then the others of its round, which wait for its parts
                stage, replica, _ = calls[index]
                for partner, pool in enumerate(pools):
                    if partner in left or tasks[partner].done():
                        continue
                    if calls[partner][0] == stage and replica.address in pool:
                        give_up(partner, _called_off(stage, replica, what, pool))
                        log.info("%s: %s", calls[partner][1].peer, left[partner])
    finally:
        for task in tasks:
            task.cancel()  # the caller was cancelled: so are its calls (a no-op once done)
    outcomes: list[T | BaseException] = []  # as gather's with return_exceptions
    for index, task in enumerate(tasks):
        if index in left:
            outcomes.append(left[index])
        elif task.cancelled():
            outcomes.append(asyncio.CancelledError())
        elif (error := task.exception()) is not None:
            outcomes.append(error)
        else:
            outcomes.append(task.result())
    return outcomes


def listed_as(members: list[list[Replica]], stage: int, peer: str) -> Replica | None:
    """`peer` as the registry (`members`) lists it at `stage` now, or None. By peer: a relay's
    address may change under a call that still reaches the peer."""
    if stage >= len(members):
        return None
    return next((r for r in members[stage] if r.peer == peer), None)


def _listed(members: list[list[Replica]], stage: int, replica: Replica) -> bool:
    """Whether the registry lists `replica`'s peer at `stage`."""
    return listed_as(members, stage, replica.peer) is not None


def _left_out(stage: int, replica: Replica, what: str) -> PeerUnavailable:
    return PeerUnavailable(
        f"stage {stage}: {replica.peer} was left out by the peer registry while its {what} was "
        "in flight (its load reports stopped: hung or cut off; or it went offline, moved or "
        "was banned): the call is not waited for, and the others go on without it"
    )


def _called_off(stage: int, replica: Replica, what: str, pool: Sequence[str]) -> Aborted:
    return Aborted(
        f"stage {stage}: its round's {what} was called off: {replica.peer}, a member of the "
        "round, was left out by the peer registry, and the round cannot end without its parts",
        [list(pool).index(replica.address)],
    )


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # a call that ended otherwise than cancelled, after it was given up
