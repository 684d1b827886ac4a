"""The trainer's hops: the one hop loop (`swarm.rpc.hop`) over the trainer's routes, feeding
its metrics, with a hop that found no replica raised as a `TrainerError` (the microbatch is
handed back to the coordinator)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from client.metrics import TrainerMetrics
from swarm.errors import SwarmError
from swarm.rpc.hop import HopFailed, Hopped, hop, may_have_landed
from swarm.rpc.routes import Routes
from swarm.rpc.stage_client import StageClient

__all__ = ["StageHops", "TrainerError"]

T = TypeVar("T")


class TrainerError(SwarmError):
    """A microbatch cannot be completed: no replica of a stage could serve it."""


class StageHops:
    """Hops to the replicas of `routes`, `attempts` tries each; also the hop loop's observer."""

    def __init__(self, routes: Routes, attempts: int, metrics: TrainerMetrics) -> None:
        self.routes, self.attempts, self.metrics = routes, attempts, metrics

    async def any(
        self, stage: int, call: Callable[[StageClient], Awaitable[T]], prefer: str | None = None
    ) -> tuple[str, T]:
        """Run `call` (it accumulates nothing) on a replica of `stage` (`prefer` first while it
        is eligible), retrying on others: the replica that answered and its answer."""
        done = await self._hop(stage, lambda c, _accumulate: call(c), prefer)
        assert done.peer is not None and done.result is not None
        return done.peer, done.result

    async def accumulating(
        self,
        stage: int,
        call: Callable[[StageClient, bool], Awaitable[T]],
        prefer: str | None = None,
        *,
        accumulate: bool,
        need_result: bool,
        landed: Callable[[SwarmError], bool] = may_have_landed,
    ) -> tuple[str | None, T | None]:
        """Run `call(client, accumulate)` on a replica of `stage`, retrying on others. Returns
        the replica that accumulated the microbatch there (None when it did not, or when a call
        may have accumulated it but did not say so: see `swarm.rpc.hop`, whose `landed` rule
        says which failures may have) and the answer (None when none was needed after such a
        call)."""
        done = await self._hop(stage, call, prefer, accumulate, need_result, landed)
        return (done.peer if done.accumulated else None), done.result

    async def hopped(
        self,
        stage: int,
        call: Callable[[StageClient, bool], Awaitable[T]],
        prefer: str | None = None,
        *,
        accumulate: bool,
        need_result: bool,
    ) -> Hopped[T]:
        """As `accumulating`, with the replica that answered whether it accumulated or not
        (the route record of pool.mode = "local" names every replica a run went through)."""
        return await self._hop(stage, call, prefer, accumulate, need_result)

    async def _hop(
        self,
        stage: int,
        call: Callable[[StageClient, bool], Awaitable[T]],
        prefer: str | None,
        accumulate: bool = False,
        need_result: bool = True,
        landed: Callable[[SwarmError], bool] = may_have_landed,
    ) -> Hopped[T]:
        try:
            return await hop(
                self.routes,
                stage,
                call,
                attempts=self.attempts,
                prefer=prefer,
                accumulate=accumulate,
                need_result=need_result,
                landed=landed,
                observer=self,
            )
        except HopFailed as e:
            raise TrainerError(str(e)) from e

    # -- the hop loop's observer ----------------------------------------------------------------
    def failed(self, stage: int, peer: str) -> None:
        self.metrics.failed(stage, peer)

    def routed(self, stage: int, peer: str, throughput: float) -> None:
        self.metrics.routed(stage, peer, throughput)

    def unreported(self, stage: int, peer: str) -> None:
        self.metrics.unreported.inc()
