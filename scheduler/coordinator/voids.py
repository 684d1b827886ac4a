"""Voids: a replica's gradients of a step that must not count, replayed elsewhere and dropped
there (`Discard`). One per coordinator, made before the commit and the bans that void through it
(`scheduler.coordinator.trust.bans` is given `void_duplicate` when it is made); the commit tells
it when a step's PREPARE or APPLY is deciding, and a straggler's duplicate voided then waits for
the attempt to end (`deciding`, `decided`)."""

from __future__ import annotations

import logging

from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.replicas import GONE
from scheduler.coordinator.round_context import RoundContext
from swarm.errors import SwarmError

__all__ = ["Voids"]

log = logging.getLogger(__name__)


class Voids:
    def __init__(self, context: RoundContext) -> None:
        self.clients, self.membership, self.metrics = (
            context.clients,
            context.membership,
            context.metrics,
        )
        self._deciding: StepLedger | None = None  # whose PREPARE or APPLY is running
        self._held: list[tuple[int, str]] = []  # voids of stragglers' duplicates that wait for it

    async def void(self, ledger: StepLedger, stage: int, peer: str) -> None:
        """`peer`'s gradients at `stage` must not count: replay them elsewhere, and tell it to
        drop them. A replica that cannot be reached is dropped from the members: if it comes
        back (restarted, empty), it copies a live replica at a step boundary."""
        lost = ledger.lose(peer, stage)
        self.metrics.replays.inc(len(lost))
        log.warning(
            "step %d: voiding %s's gradients at stage %d (replaying %s)",
            ledger.step,
            peer,
            stage,
            lost,
        )
        replica = next((r for r in self.membership.replicas()[stage] if r.peer == peer), None)
        if replica is not None:
            try:
                await self.clients.get(stage, replica).discard(ledger.step)
            except GONE as e:
                log.warning("discard on %s failed: %s", peer, e)
                self.membership.drop(peer)
            except SwarmError as e:  # refused: the next receipt check drops it (`commit.py`)
                log.warning("discard on %s failed: %s", peer, e)

    async def void_duplicate(self, ledger: StepLedger, stage: int, peer: str) -> None:
        """`peer` accumulated a gradient at `stage` that another replica's counts for (a
        straggling trainer's). Voided at once (while the commit gathers receipts too: it sees
        the ledger change and waits), unless this step's PREPARE or APPLY is running:
        then a Discard would wipe what `peer` prepared, fail its APPLY and drop it from a step
        that commits whole all the same (a replica averages a copy of its sums taken when it
        prepares, so the duplicate never reaches them; one that landed before is refused by
        PREPARE's receipt check). Held until the attempt ends; voided then if it failed."""
        if self._deciding is ledger:
            self._held.append((stage, peer))
            return
        await self.void(ledger, stage, peer)

    def deciding(self, ledger: StepLedger) -> None:
        """`ledger`'s PREPARE or APPLY runs from now: a duplicate of its step is held."""
        self._deciding = ledger

    def decided(self) -> list[tuple[int, str]]:
        """The attempt ended: the (stage, peer) duplicates held meanwhile, to void where it
        failed (its caller's)."""
        self._deciding = None
        held, self._held = self._held, []
        return held
