"""The one hop loop: a call to some replica of one stage, tried through the wiring until one
answers. The trainer's hops on both data planes and a replica's next hop on the push plane all
go through `hop`; the wiring's bookkeeping (`started`, `busy`, `failed`, `finished`) is called
here and nowhere else, so every sender feeds the wiring the same way.

Each try: choose the replica with the smallest expected finish time (or `prefer`, while it is
eligible), mark it started, call. A replica that answers busy is not at fault: the next try goes
elsewhere and it gets no backoff. One that fails is put in backoff (the wiring's pause, not an
audit's ban) and the next try goes elsewhere; why it failed is kept (`Routes.causes`, logged at
WARNING for the first failure behind each backoff) and named by `HopFailed`, so a failure deep in
the pipeline reaches the trainer with its code and text. One that answers has its service time
recorded: the call's time less what it waited in the replica's queue, since the wiring adds
queued work itself.

Exactness: a failed accumulating call may have accumulated all the same (`landed` says which
errors leave that possible). Its stage is then never accumulated again from this hop: a second
receipt at a stage would void the first replica's step there. The tries left go on without
accumulating, for the answer the caller still needs, or the hop ends at once when it needs none;
`Hopped.accumulated` tells the caller to leave that stage to the coordinator (which adopts the
late receipt or replays it)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from swarm.errors import Busy, PeerUnavailable, RemoteError, SwarmError
from swarm.policy.wiring import NoReplicaError
from swarm.rpc.causes import Cause, bounded, described
from swarm.rpc.routes import Routes
from swarm.rpc.stage_client import StageClient

__all__ = ["HopFailed", "HopObserver", "Hopped", "any_error", "hop", "may_have_landed"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class HopFailed(SwarmError):
    """No replica of the stage gave an answer: none was eligible, the tries ran out, or the
    deadline passed. Its text names the last failed call behind it (`cause`): the peer, and the
    code and text it failed with."""

    def __init__(self, message: str, cause: Cause | None = None) -> None:
        super().__init__(bounded(message))
        self.cause = cause


@dataclass(frozen=True)
class Hopped(Generic[T]):
    """The replica that answered, its answer (None: the hop ended after a call that may have
    accumulated, when no answer was needed), and whether the answering call accumulated."""

    peer: str | None
    result: T | None
    accumulated: bool


class HopObserver(Protocol):
    """What a hop tells its owner's metrics (the trainer's; a replica's next hop keeps none)."""

    def failed(self, stage: int, peer: str) -> None: ...

    def routed(self, stage: int, peer: str, throughput: float) -> None: ...

    def unreported(self, stage: int, peer: str) -> None: ...


def may_have_landed(error: SwarmError) -> bool:
    """Whether a failed accumulating call may have accumulated all the same: the replica did not
    answer (a deadline, a dropped connection: `PeerUnavailable`) or answered with an error of its
    own (`RemoteError`: a bug there, perhaps after accumulating). A refusal (`WireError`: a stale
    step, a bad request, activations not cached) says it took nothing."""
    return isinstance(error, PeerUnavailable | RemoteError)


def any_error(error: SwarmError) -> bool:
    """For a call that passes work on before it may fail (a push to the next stage): any failure
    may have left receipts behind it."""
    return True


async def hop(
    routes: Routes,
    stage: int,
    call: Callable[[StageClient, bool], Awaitable[T]],
    *,
    attempts: int,
    prefer: str | None = None,
    accumulate: bool = False,
    need_result: bool = True,
    deadline: float | None = None,
    landed: Callable[[SwarmError], bool] = may_have_landed,
    observer: HopObserver | None = None,
) -> Hopped[T]:
    """Up to `attempts` tries of `call(client, accumulate)` on replicas of `stage` (`prefer`
    first while it is eligible), until `deadline` (`time.monotonic()`) if one is given. Raises
    `HopFailed` when none answered and an answer was needed."""
    pool, samples = routes.wiring[stage], routes.job.training.microbatch_size
    last: BaseException | None = None
    tried, why = 0, f"{attempts} attempt(s) failed"
    for _ in range(attempts):
        if deadline is not None and deadline <= time.monotonic():
            why = f"its deadline passed after {tried} attempt(s)"
            break
        try:
            # `eligible` sorts the pool: asked only when there is a preferred replica.
            preferred = prefer is not None and prefer in pool.eligible()
            peer = prefer if preferred else pool.choose(samples)
        except NoReplicaError as e:
            raise _failed(routes, stage, str(e)) from last
        tried += 1
        assert peer is not None
        prefer = None
        pool.started(peer, samples)
        start = time.perf_counter()
        client = None  # none made: an address no client can dial (`RouteClients`)
        try:
            client = routes.clients[peer]  # it may depart (a new view) while the call runs
            result = await call(client, accumulate)
        except Busy as e:  # its queue is full: not its fault, try another
            pool.busy(peer, samples)
            last = e
            continue
        except SwarmError as e:  # a stage client raises nothing else for a failed call
            _count_failure(routes, stage, peer, client, e, observer)
            last = e
            if accumulate and landed(e):
                accumulate = False
                if observer is not None:
                    observer.unreported(stage, peer)
                log.info(
                    "stage %d: %s may have accumulated all the same: left to the coordinator",
                    stage,
                    peer,
                )
                if not need_result:
                    return Hopped(None, None, False)
            continue
        elapsed = time.perf_counter() - start
        queued = getattr(result, "queued_seconds", None)
        if queued is None:  # a call whose answer does not say: the client kept it
            queued = client.last_queued_s
        # The replica's word for its wait, believed only where it could be one: within the
        # call's own time. A NaN, a negative or a week's made it the fastest of its stage,
        # chosen for every hop after; a wait it could not have had is taken as none.
        queued = queued if 0.0 <= queued <= elapsed else 0.0  # NaN compares false
        if peer in pool:  # it may have left (or moved stage) while the call ran
            pool.finished(peer, samples, max(1e-6, elapsed - queued))
            if observer is not None:
                observer.routed(stage, peer, pool.throughput(peer))
        return Hopped(peer, result, accumulate)
    if isinstance(last, Busy):  # the last try found a full queue: say so, not an older failure
        raise HopFailed(f"stage {stage}: {why}, the last {described(last)}") from last
    raise _failed(routes, stage, why) from last


def _count_failure(
    routes: Routes,
    stage: int,
    peer: str,
    client: StageClient | None,
    e: SwarmError,
    observer: HopObserver | None,
) -> None:
    """A call to `peer` over `client` (None: none could be made) failed with `e`: its path past
    its relay given up where that was the way, the replica in backoff, the cause kept."""
    if isinstance(e, PeerUnavailable):  # dialled past its relay: through it again
        routes.lost(peer, client)
    pool, backoff_s = routes.wiring[stage], 0.0
    if peer in pool:  # it may have left (or moved stage) while the call ran
        backoff_s = pool.failed(peer, routes.job.training.microbatch_size)
        if observer is not None:  # not for a departed peer: no new series
            observer.failed(stage, peer)
    routes.causes.failed(stage, peer, e, backoff_s)


def _failed(routes: Routes, stage: int, why: str) -> HopFailed:
    """The hop's failure: `why`, and the last failed call to `stage` behind it (the one that put
    its replicas in backoff, when none was eligible), with when."""
    cause = routes.causes.last(stage)
    if cause is None:
        return HopFailed(f"stage {stage}: {why}")
    return HopFailed(f"stage {stage}: {why}; last failure at {cause.clock_time}: {cause}", cause)
