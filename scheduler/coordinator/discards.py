"""A re-admitted replica's work under way, discarded first: `Discards`.

Before a stage is declared lost, a former replica that answers at the job's step is made a member
again (`Membership.readmit`); its gradients of the steps under way are discarded first (its
microbatches are replayed), by a Discard the scheduler signs. A Discard that the replica refuses
leaves it out. But one that got no answer at all may have met a path that changed between the
replica's Info and the Discard (its relay died, and it re-attached to another at once): it held
its stage's state a moment ago, and declaring the stage lost then rolls every stage back to the
last checkpoint, the state thrown away. So its stage waits for the rollback's next try, which
asks it again at the address the registry lists it at then, over a new connection; after
`TRIES` tries in a row that got no answer it is given up, and the stage is lost."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeAlias

from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.metrics import CoordinatorMetrics
from scheduler.coordinator.replicas import ReplicaClients
from swarm.errors import PeerUnavailable, SwarmError
from swarm.rpc.lease import Replica

__all__ = ["Discards", "Said"]

log = logging.getLogger(__name__)

#: `said(stage, peer, text)`: a Discard's wait or give-up, for the job's history (`swarm status`)
Said: TypeAlias = Callable[[int, str, str], None]


class Discards:
    # Tries in a row (each a rollback's, backing off from 0.5 s) at which a stage waits for a
    # replica that answers at the step but whose Discard gets no answer, before it is lost.
    TRIES = 4

    def __init__(
        self,
        clients: ReplicaClients,
        metrics: CoordinatorMetrics,
        ledgers: Callable[[], list[StepLedger]],
    ) -> None:
        """`ledgers()`: those of the steps not yet applied, oldest first."""
        self.clients, self.metrics, self.ledgers = clients, metrics, ledgers
        self._lost: dict[str, int] = {}  # peer -> tries in a row its Discard got no answer
        # A stage that waits on a Discard has no member, so status says it stalled; these say
        # why it neither resumes nor rolls back yet, and when it gave up.
        self.said: list[Said] = []

    async def discard(self, stage: int, r: Replica, step: int) -> bool | None:
        """Discard `r`'s gradients of `step` and of the later steps under way (their work is
        replayed): whether it did. None: a call got no answer, and its stage waits for the
        next try rather than be lost (the `TRIES`-th such try in a row gives it up: False)."""
        ledgers = [ledger for ledger in self.ledgers() if ledger.step >= step]
        for ledger in ledgers:
            self.metrics.replays.inc(len(ledger.lose(r.peer, stage)))
        try:
            for discarded in sorted({step, *(ledger.step for ledger in ledgers)}):
                await self.clients.get(stage, r).discard(discarded)
        except PeerUnavailable as e:
            self.clients.drop(stage, r)  # a failed channel waits out its reconnect backoff
            return self._unanswered(stage, r, step, e)
        except SwarmError as e:
            self._lost.pop(r.peer, None)
            self._say(
                stage, r.peer, f"stage {stage}: {r.peer} not re-admitted (discard failed): {e}"
            )
            return False
        self._lost.pop(r.peer, None)
        return True

    def _unanswered(self, stage: int, r: Replica, step: int, e: PeerUnavailable) -> bool | None:
        tries = self._lost.get(r.peer, 0) + 1
        if tries >= self.TRIES:
            self._lost.pop(r.peer, None)
            self._say(
                stage,
                r.peer,
                f"stage {stage}: {r.peer} not re-admitted: its discard got no answer {tries} "
                f"times, the last: {e}",
            )
            return False
        self._lost[r.peer] = tries
        self._say(
            stage,
            r.peer,
            f"stage {stage}: {r.peer} answers at step {step} but its discard got no answer ({e}): "
            f"the stage is not lost, and waits for the next try ({tries + 1} of {self.TRIES})",
        )
        return None

    def _say(self, stage: int, peer: str, text: str) -> None:
        log.warning("%s", text)
        for told in self.said:
            told(stage, peer, text)
