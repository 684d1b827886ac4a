"""The one hop loop: a call to some replica of one stage, tried through the wiring until one
answers. The trainer's hops on both data planes and a replica's next hop on the push plane all
go through `hop`; the wiring's bookkeeping (`started`, `busy`, `failed`, `finished`) is called
here and nowhere else, so every sender feeds the wiring the same way.

Each try: choose the replica with the smallest expected finish time (or `prefer`, while it is
eligible), mark it started, call. A replica that answers busy is not at fault: the next try goes
elsewhere and it is not banned. One that fails is banned with backoff and the next try goes
elsewhere. One that answers has its service time recorded: the call's time less what it waited
in the replica's queue, since the wiring adds queued work itself.

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
from swarm.rpc.routes import Routes
from swarm.rpc.stage_client import StageClient

__all__ = ["HopFailed", "HopObserver", "Hopped", "any_error", "hop", "may_have_landed"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class HopFailed(SwarmError):
    """No replica of the stage gave an answer: none was eligible, the tries ran out, or the
    deadline passed."""


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
    for _ in range(attempts):
        if deadline is not None and deadline <= time.monotonic():
            break
        try:
            # `eligible` sorts the pool: asked only when there is a preferred replica.
            preferred = prefer is not None and prefer in pool.eligible()
            peer = prefer if preferred else pool.choose(samples)
        except NoReplicaError as e:
            raise HopFailed(f"stage {stage}: {e}") from last
        assert peer is not None
        prefer = None
        pool.started(peer, samples)
        start = time.perf_counter()
        try:
            client = routes.clients[peer]  # it may depart (a new view) while the call runs
            result = await call(client, accumulate)
        except Busy as e:  # its queue is full: not its fault, try another
            pool.busy(peer, samples)
            last = e
            continue
        except SwarmError as e:  # a stage client raises nothing else for a failed call
            if isinstance(e, PeerUnavailable):  # dialled past its relay: through it again
                routes.lost(peer)
            if peer in pool:  # it may have left (or moved stage) while the call ran
                pool.failed(peer, samples)
                if observer is not None:  # not for a departed peer: no new series
                    observer.failed(stage, peer)
            last = e
            if accumulate and landed(e):
                accumulate = False
                if observer is not None:
                    observer.unreported(stage, peer)
                log.info(
                    "stage %d: %s failed (%r) and may have accumulated all the same; "
                    "left to the coordinator",
                    stage,
                    peer,
                    e,
                )
                if not need_result:
                    return Hopped(None, None, False)
                continue
            log.info("stage %d: %s failed (%r); trying another replica", stage, peer, e)
            continue
        queued = getattr(result, "queued_seconds", None)
        if queued is None:  # a call whose answer does not say: the client kept it
            queued = client.last_queued_s
        if peer in pool:  # it may have left (or moved stage) while the call ran
            pool.finished(peer, samples, max(1e-6, time.perf_counter() - start - queued))
            if observer is not None:
                observer.routed(stage, peer, pool.throughput(peer))
        return Hopped(peer, result, accumulate)
    raise HopFailed(f"stage {stage}: {attempts} attempts failed: {last}")
