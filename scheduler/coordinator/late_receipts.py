"""The coordinator's late-receipt check: before microbatches given back are leased again, a
Backward that timed out at its trainer may still have landed on a replica. A receipt for a
microbatch the ledger still needs at that stage is adopted (that replica holds it, exactly as a
replay would make it), so the late receipt is neither replayed elsewhere nor voids its replica.
One check runs at a time."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.live_steps import LiveSteps
from scheduler.coordinator.replicas import ReplicaClients
from scheduler.coordinator.round_strategy import Rounds
from swarm.proto import stage_pb2 as pb
from swarm.rpc.lease import Replica

__all__ = ["LateReceipts"]

log = logging.getLogger(__name__)


class LateReceipts:
    def __init__(
        self,
        clients: ReplicaClients,
        replicas: Callable[[], list[list[Replica]]],
        window: LiveSteps,
        rounds: Rounds,
        microbatch_size: int,
        *,
        wake: Callable[[], None],
        checked: Callable[[StepLedger], None],
    ) -> None:
        """`replicas()`: the members, per stage; `wake()` once a check ends (leases look
        again); `checked(ledger)` once `ledger`'s check is done (its step may be complete)."""
        self.clients, self.replicas, self.window, self.rounds = clients, replicas, window, rounds
        self.size, self.wake, self.checked = microbatch_size, wake, checked
        self._task: asyncio.Task[None] | None = None  # the check in flight

    def check(self, ledger: StepLedger, returned: list[int]) -> None:
        """Check the replicas for late receipts of `returned` (given back), unless a check is
        running already (the next lease checks again)."""
        if self._task is None:
            self._task = asyncio.create_task(self._check(ledger, returned))

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _check(self, ledger: StepLedger, returned: list[int]) -> None:
        try:
            pairs = [(k, r) for k, stage in enumerate(self.replicas()) for r in stage]
            infos = await asyncio.gather(
                *(self.clients.get(k, r).info() for k, r in pairs), return_exceptions=True
            )
            if ledger not in self.window.ledgers():
                return
            if self.rounds.adopts_late_receipts:
                self._adopt(ledger, returned, pairs, infos)
            ledger.checked(returned)
        finally:
            self._task = None
            self.wake()
        self.checked(ledger)

    def _adopt(
        self,
        ledger: StepLedger,
        returned: list[int],
        pairs: list[tuple[int, Replica]],
        infos: list[pb.StageInfoResponse | BaseException],
    ) -> None:
        for (stage, r), info in zip(pairs, infos, strict=True):
            if isinstance(info, BaseException):
                continue  # gone: the commit's own checks deal with it
            receipts = self.window.receipts(info, ledger.step)
            if receipts is None:
                continue  # elsewhere: the commit's own checks deal with it
            adopted = ledger.adopt(stage, r.peer, receipts, set(returned), self.size)
            if adopted:
                log.info(
                    "step %d: %s's late receipts %s at stage %d adopted",
                    ledger.step,
                    r.peer,
                    adopted,
                    stage,
                )
