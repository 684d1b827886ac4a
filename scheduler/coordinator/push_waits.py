"""The late-receipt check's waits for pushes still in flight
(`scheduler.coordinator.late_receipts`): a microbatch given back whose push a member names as
still being computed under its lease's run (`StageInfoResponse.in_flight`) is not leased again
until that push ends, so its receipt is adopted where it lands rather than voiding its replica
after the replay went out under a new run.

Each wait is once a microbatch, a stage and a ledger (a replay overloaded at another stage waits
again; a rollback's ledger of the same step starts afresh), and at most `wait_s`, the push's own
deadline, by the ledger's clock: a member naming a push forever holds it up that long once. While
a ledger waits, its checks are `PACE_S` apart by the event loop's time (each asks every member's
Info), and a paused ledger leaves the check to the others meanwhile."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from scheduler.coordinator.ledger import StepLedger

__all__ = ["PACE_S", "PushWaits"]

log = logging.getLogger(__name__)

PACE_S = 0.5  # between two checks of a ledger while a push given back is still in flight


@dataclass
class _Waits:
    """One ledger's: when each (index, stage) began to wait, those whose wait ran out (said
    once), and the loop time before which its next check waits."""

    ledger: StepLedger
    began: dict[tuple[int, int], float] = field(default_factory=dict)
    ended: set[tuple[int, int]] = field(default_factory=set)
    paused_until: float = 0.0


class PushWaits:
    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self._of: dict[int, _Waits] = {}  # id(ledger) -> its waits (the ledger held: ids unique)

    def paused(self, ledger: StepLedger) -> bool:
        """Whether `ledger` waits and its next check is not due yet."""
        waits = self._of.get(id(ledger))
        return waits is not None and asyncio.get_running_loop().time() < waits.paused_until

    def said(self, ledger: StepLedger) -> str:
        """`ledger`'s microbatches that wait for their pushes now, in words for a stall's message
        ("" when none does): without them, a step waiting so reads as held by no trainer."""
        waits = self._of.get(id(ledger))  # (held with its ledger: an id is never another's)
        if waits is None:
            return ""
        now = ledger.clock.now()
        left = [(i, self.wait_s - (now - t)) for (i, _), t in waits.began.items()]
        waiting = [(i, s) for i, s in left if s > 0]  # an index may wait at several stages
        if not waiting:
            return ""
        return (
            f"; microbatch(es) {sorted({i for i, _ in waiting})} wait for their pushes still in "
            f"flight (at most {max(s for _, s in waiting):.0f} s more)"
        )

    def flying(
        self, ledger: StepLedger, named: dict[int, dict[int, set[str]]], live: list[StepLedger]
    ) -> set[int]:
        """Of the microbatches given back that members name in flight (`named`: index -> stage
        -> the peers naming it there, each a push of the lease's run that the ledger still
        needs there), those that wait now; `live`: the ledgers open (the others' waits go)."""
        self._of = {key: w for key, w in self._of.items() if any(w.ledger is o for o in live)}
        if not named:
            return set()
        waits = self._of.setdefault(id(ledger), _Waits(ledger))
        now, flying = ledger.clock.now(), set()
        for index, stages in sorted(named.items()):
            for stage, peers in sorted(stages.items()):
                if self._waiting(ledger, waits, (index, stage), now, sorted(peers)):
                    flying.add(index)
        if flying:
            waits.paused_until = asyncio.get_running_loop().time() + PACE_S
        return flying

    def _waiting(
        self, ledger: StepLedger, waits: _Waits, key: tuple[int, int], now: float, peers: list[str]
    ) -> bool:
        index, stage = key
        where = f"{', '.join(peers)} (stage {stage})"
        if key not in waits.began:
            waits.began[key] = now
            log.info(
                "step %d: microbatch %d, given back, is still being pushed at %s: leased again "
                "once that push ends, or in %g s",
                ledger.step,
                index,
                where,
                self.wait_s,
            )
        if now - waits.began[key] < self.wait_s:
            return True
        if key not in waits.ended:
            waits.ended.add(key)
            log.warning(
                "step %d: microbatch %d is still being pushed at %s after %g s: leased again (a "
                "receipt that push leaves under its old run voids its replica)",
                ledger.step,
                index,
                where,
                self.wait_s,
            )
        return False
