"""Voids: a replica's gradients of a step that must not count, replayed elsewhere and dropped
there (`Discard`). One per coordinator, made before the commit and the bans that void through it
(`scheduler.coordinator.trust.bans` is given `void_duplicate` when it is made); the commit tells
it when a step's PREPARE or APPLY is deciding, and a straggler's duplicate voided then waits for
the attempt to end (`deciding`, `decided`).

A trainer's word is what a lessee reports: which replica holds its microbatch at each stage.
Any token holder may lease, so a replica is voided on its own receipts, never on that word alone:
a second holder reported is voided where its receipts show the duplicate (`straggler`), and a
holder whose receipts lack what the ledger credits it with has those microbatches needed again
there, nothing of its own voided (`belied`). Nobody is blamed for either: the receipts are a
replica's word, which cannot tell a trainer's lie from a replica's (a hostile replica denying a
receipt would have honest trainers doubted, and their audits of it not taken)."""

from __future__ import annotations

import logging

from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.replicas import GONE
from scheduler.coordinator.round_context import RoundContext
from swarm.errors import SwarmError
from swarm.rpc.causes import brief

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
                self.membership.drop(peer, f"its Discard failed ({brief(e)})")
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

    async def straggler(
        self, ledger: StepLedger, stage: int, peer: str, index: int, trainer: str
    ) -> None:
        """`trainer` reported `peer` a second holder of microbatch `index` at `stage` (a
        straggler's duplicate, `StepLedger.report`'s extras): voided where `peer`'s receipts
        show it, or it cannot be asked (a gone replica is dropped by its void); else nobody
        is voided."""
        if await self._holds(ledger, stage, peer, index) is False:
            ledger.suspect = True  # the commit looks at every replica's receipts first
            log.warning(
                "step %d: trainer %.64s reported %s a second holder of microbatch %d at stage "
                "%d, whose receipts do not show it: nobody voided",
                ledger.step,
                trainer,
                peer,
                index,
                stage,
            )
            return
        await self.void_duplicate(ledger, stage, peer)

    def belied(self, ledger: StepLedger, stage: int, peer: str, missing: list[int]) -> None:
        """`peer`'s receipts at `stage` lack `missing`, which the ledger credits it with, and
        hold nothing else: a trainer's word belied (or the replica's receipts lost). Those
        microbatches are needed there again; what `peer` holds stays."""
        trainers = ledger.unland(stage, peer, missing)
        self.metrics.replays.inc(len(missing))
        log.warning(
            "step %d: %s (stage %d) holds no receipt of microbatches %s, which trainer %s "
            "reported it holds: they are run again, nothing of %s voided",
            ledger.step,
            peer,
            stage,
            missing[:10],
            ", ".join(sorted(t[:64] for t in trainers)) or "(none known)",
            peer,
        )

    async def _holds(self, ledger: StepLedger, stage: int, peer: str, index: int) -> bool | None:
        """Whether `peer`'s receipts of `ledger`'s step hold `index`; None: not known."""
        replica = next((r for r in self.membership.replicas()[stage] if r.peer == peer), None)
        if replica is None:
            return None
        try:
            info = await self.clients.get(stage, replica).info()
        except SwarmError:
            return None
        return info.step != ledger.step or index in info.receipts

    def deciding(self, ledger: StepLedger) -> None:
        """`ledger`'s PREPARE or APPLY runs from now: a duplicate of its step is held."""
        self._deciding = ledger

    def decided(self) -> list[tuple[int, str]]:
        """The attempt ended: the (stage, peer) duplicates held meanwhile, to void where it
        failed (its caller's)."""
        self._deciding = None
        held, self._held = self._held, []
        return held
