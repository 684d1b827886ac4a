"""The coordinator's side of the eager rules (`pool.overlap = "eager"`: local-eager, and
step-eager's rounds of one step): `EagerRounds`, the local rule's rounds (`rounds`) whose
averaging overlaps the next round.

A round's end waits for no network (`_end`): every member takes its outer step at once
(`EagerOp.STEP`: the last round's average plus its fresh share minus its last share), and the
pools sum the fresh shares in the background (`EagerOp.AVERAGE`) while the next round trains;
the next round's end waits for that sum first (`drain`), as do a checkpoint and a copy's
admission (they need every member's state whole). A member that fails the averaging is dropped
and the others sum again without it: its share of the round is lost (its samples counted as
dropped), and the next round's record says whose shares the average holds (`Sync.averaged`).
The job's last round is waited for (`EagerOp.LAST`: the whole sum, then the outer step) and the
trained model is the members' mean (`EagerOp.MEAN`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

from scheduler.coordinator.groups import RoundGroup
from scheduler.coordinator.round_context import RoundContext
from scheduler.coordinator.rounds import PoolRounds, RoundCall, peers
from scheduler.coordinator.trust.sum_checks import Checksums
from swarm.job.rule import EagerOp
from swarm.model.routes import Sync
from swarm.rpc.lease import Replica

__all__ = ["EagerRounds"]


class EagerRounds(PoolRounds):
    """Rounds whose averaging overlaps the next round."""

    def __init__(self, context: RoundContext) -> None:
        super().__init__(context)
        # The last round's averaging under way (its result: per stage, the members whose
        # shares it summed), the members that took each stage's last outer step, and whose
        # shares made each stage's last average once it is known
        self._pending: asyncio.Task[dict[int, tuple[str, ...]]] | None = None
        self._stepped: dict[int, tuple[str, ...]] = {}
        self._averaged: dict[int, tuple[str, ...]] = {}

    async def _resumed(self, step: int, members: list[list[Replica]], synced: list[int]) -> None:
        """A coordinator resuming mid-job does not know whether its predecessor's sum of the
        last round's shares arrived: it is summed again (the same shares, so the same sum where
        it had). (A round left unended is not, yet: its background sum fails and the stage
        rolls back.)"""
        last = step - step % self.rule.round_steps  # the last round's end at or before `step`
        if last > 0 and all(members):
            copied = [list(replicas) for replicas in members]
            self._pending = asyncio.get_running_loop().create_task(
                self._sum_shares(last - 1, copied, {})
            )

    def restarted(self) -> None:
        super().restarted()
        self.cancel()
        self._stepped, self._averaged = {}, {}

    @property
    def pending(self) -> bool:
        """Whether a round's averaging is not drained yet."""
        return self._pending is not None

    async def drain(self) -> None:
        """Wait for the last round's averaging, retried without the members that fail
        it; `CommitStalled` once it failed `runtime.max_commit_rounds` times."""
        task = self._pending
        if task is None:
            return
        try:
            self._averaged.update(await asyncio.shield(task))
        finally:
            if task.done():
                self._pending = None

    def cancel(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None

    def can_admit(self, step: int) -> bool:
        """Not while a round's sum is under way, either (a copy must hold it)."""
        return super().can_admit(step) and not self.pending

    async def whole(self, step: int) -> None:
        """Where a round starts, the round's sum is waited for (else it overlaps the next)."""
        if self.pending and self.starts_round(step):
            await self.drain()

    async def _end(self, step: int) -> list[Sync]:
        """The last round's sum first (`drain`), then every member's outer
        step, at once; this round's sum goes on in the background. The job's last round is
        `_end_last`."""
        await self.drain()
        if step + 1 >= self.job.training.steps:
            return await self._end_last(step)
        boundary, members = step + 1, await self._every_stage_served()
        totals = [sum(self._samples[(k, r.peer)] for r in rs) for k, rs in enumerate(members)]
        stepped = await self._apply(
            step,
            members,
            lambda c, k: c.eager(EagerOp.STEP, boundary, totals[k]),
            drop=True,
        )
        syncs = [
            Sync(step, k, peers(replicas), self._averaged_of(k))
            for k, replicas in enumerate(members)
        ]
        self._stepped = {k: peers(rs) for k, rs in enumerate(members) if totals[k]}
        # A stage whose round took no sample took no outer step: nothing to sum.
        summing = [rs if totals[k] else [] for k, rs in enumerate(stepped)]
        samples = {key: n for key, n in self._samples.items() if n}
        failed = {
            (k, r.peer): samples.get((k, r.peer), 0)
            for k, rs in enumerate(members)
            for r in rs
            if r not in stepped[k]
        }
        await self._say(self._count_dropped(step, failed, "failed the round's outer step"))
        self._pending = asyncio.create_task(self._sum_shares(step, summing, samples))
        return syncs

    async def _sum_shares(
        self, step: int, members: list[list[Replica]], samples: dict[tuple[int, str], int]
    ) -> dict[int, tuple[str, ...]]:
        """The background sum of the round's shares (`EagerOp.AVERAGE`); per stage, whose. The
        samples of a member whose share it could not sum are dropped (`samples`: the round's)."""
        call, began = self._eager_call(step + 1, EagerOp.AVERAGE), time.monotonic()
        summed = await self._until_summed(step, "eager", call, members)
        self.averaged(began, await self.moved(summed))
        kept = {(k, r.peer) for k, rs in enumerate(summed) for r in rs}
        lost = {
            (k, r.peer): samples.get((k, r.peer), 0)
            for k, rs in enumerate(members)
            for r in rs
            if (k, r.peer) not in kept
        }
        await self._say(self._count_dropped(step, lost, "failed the round's averaging"))
        return {k: peers(rs) for k, rs in enumerate(summed) if members[k]}

    async def _end_last(self, step: int) -> list[Sync]:
        """The job's last round: the whole sum of the fresh shares (`EagerOp.LAST`'s PREPARE),
        every member's outer step with it (its APPLY), then the members' mean
        (`EagerOp.MEAN`), the trained model."""
        boundary, began = step + 1, time.monotonic()
        members = await self._until_summed(step, "last", self._eager_call(boundary, EagerOp.LAST))
        applied = await self._apply(
            step, members, lambda c, k: c.eager_last_apply(boundary), drop=True
        )
        meaned = await self._until_summed(
            step, "mean", self._eager_call(boundary, EagerOp.MEAN), applied
        )
        self.averaged(began, await self.moved(members) + await self.moved(meaned))
        syncs = []
        for k, replicas in enumerate(members):
            group, mean = peers(replicas), peers(meaned[k])
            syncs.append(
                Sync(step, k, group, self._averaged_of(k), None if mean == group else mean)
            )
        return syncs

    def _averaged_of(self, stage: int) -> tuple[str, ...] | None:
        """Whose shares made `stage`'s last average, for the record: None when they are all
        that took the last outer step (the record's default)."""
        averaged = self._averaged.get(stage)
        return None if averaged is None or averaged == self._stepped.get(stage) else averaged

    def _eager_call(self, boundary: int, op: EagerOp) -> RoundCall:
        """`op`'s PREPARE of the round ending at `boundary` on one member."""

        def call(
            stage: int,
            r: Replica,
            total: int,
            group: RoundGroup,
            index: int,
            rid: str,
            checks: Checksums | None,
        ) -> Awaitable[object]:
            return self.clients.get(stage, r).eager(
                op,
                boundary,
                total,
                list(group.members),
                index,
                rid,
                parts=group.parts,
                checks=checks,
                peers=group.peers,
            )

        return call
