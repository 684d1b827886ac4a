"""The coordinator's late-receipt check: before microbatches given back are leased again, a
Backward that timed out at its trainer may still have landed on a replica. Under the plain rules
a receipt for a microbatch the ledger still needs at that stage is adopted where it names the run
of the lease given back (that replica holds it, exactly as a replay would make it), so the late
receipt is neither replayed elsewhere nor voids its replica. A receipt under another run is a
push that lease did not send: a member ahead on the route, holding the stage's ticket, can fail
the honest hop, wait for this check to pass, and push the lessee's old run with inputs of its
own; the replay, under a new run, is then refused there (`StepSums.other_run`) and given back
again, and its replica is voided here before the next replay goes out. Under local rounds a
receipt names no run for the route record: its replica is voided at once, before the replay goes
out, since a replay landing on that same replica would be answered as a duplicate and the stray
gradient would stand in the step. One check runs at a time.

A microbatch given back whose push a replica names as still in flight under its lease's run
(`StageInfoResponse.in_flight`: an overloaded replica's compute, still running after its caller's
deadline passed) is not leased again until that push ends: its receipt is then adopted where it
lands (`scheduler.coordinator.push_waits`, which bounds the wait). Replayed at once, it would
land after the replay went out under a new run, and void its replica (the late receipt under
another run, above). One named under another run is no push of the lease's, nor one at a stage
the ledger no longer needs: not waited for; nor any where the rules adopt no late receipt (local
rounds: it voids its replica either way)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator

from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.live_steps import LiveSteps
from scheduler.coordinator.push_waits import PACE_S, PushWaits
from scheduler.coordinator.replicas import ReplicaClients
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
        adopts: bool,
        microbatch_size: int,
        *,
        void: Callable[[StepLedger, int, str], Awaitable[None]],
        wake: Callable[[], None],
        checked: Callable[[StepLedger], None],
        wait_s: float,
    ) -> None:
        """`replicas()`: the members, per stage; `adopts`: whether a late receipt under its
        lease's run is adopted where it landed (`Rounds.adopts_late_receipts`), else its replica
        is `void(ledger, stage, peer)`ed, as one under another run always is; `wake()` once a
        check ends (leases look again);
        `checked(ledger)` once `ledger`'s check is done (its step may be complete); `wait_s`: how
        long a microbatch waits for its push still in flight (the push's deadline)."""
        self.clients, self.replicas, self.window, self.adopts = clients, replicas, window, adopts
        self.size, self.void, self.wake, self.checked = microbatch_size, void, wake, checked
        self.waits = PushWaits(wait_s)
        self._task: asyncio.Task[None] | None = None  # the check in flight
        self._again: asyncio.TimerHandle | None = None  # a paused ledger's next look

    def check(self, ledger: StepLedger, returned: list[int]) -> None:
        """Check the replicas for late receipts of `returned` (given back), unless a check is
        running already or `ledger`'s waits for pushes in flight pause it (the next lease
        checks again)."""
        if self._task is None and not self.waits.paused(ledger):
            self._task = asyncio.create_task(self._check(ledger, returned))

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._again is not None:
            self._again.cancel()

    async def _check(self, ledger: StepLedger, returned: list[int]) -> None:
        try:
            pairs = [(k, r) for k, stage in enumerate(self.replicas()) for r in stage]
            infos = await asyncio.gather(
                *(self.clients.get(k, r).info() for k, r in pairs), return_exceptions=True
            )
            if ledger not in self.window.ledgers():
                return
            voided = await self._sort(ledger, returned, pairs, infos)
            named = self._named(ledger, returned, pairs, infos, voided)
            flying = self.waits.flying(ledger, named, self.window.ledgers())
            ledger.checked([index for index in returned if index not in flying])
            if flying:  # leases look again once the pause is over, and check it again
                self._again = asyncio.get_running_loop().call_later(PACE_S, self.wake)
        finally:
            self._task = None
            self.wake()
        self.checked(ledger)

    def _receipts(
        self,
        ledger: StepLedger,
        pairs: list[tuple[int, Replica]],
        infos: list[pb.StageInfoResponse | BaseException],
    ) -> Iterator[tuple[int, Replica, dict[int, int]]]:
        """(stage, replica, its receipts of `ledger`'s step: index -> run) for each member that
        answered of that step: one gone, or elsewhere, is the commit's own checks' to deal
        with."""
        for (stage, r), info in zip(pairs, infos, strict=True):
            if not isinstance(info, BaseException):
                receipts = self.window.receipts(info, ledger.step)
                if receipts is not None:
                    yield stage, r, receipts

    async def _sort(
        self,
        ledger: StepLedger,
        returned: list[int],
        pairs: list[tuple[int, Replica]],
        infos: list[pb.StageInfoResponse | BaseException],
    ) -> set[tuple[int, str]]:
        """Adopt each replica's late receipts of `returned` under their leases' runs (where the
        rules adopt), and void every replica holding one under another run (or any, where they
        do not): those voided, (stage, peer)."""
        among = set(returned)
        split = [
            (stage, r, *self._split(ledger, runs))
            for stage, r, runs in self._receipts(ledger, pairs, infos)
        ]
        # Every replica's strays first: a void below makes what its replica held leasable
        # while its Discard is awaited, and a lease then would hide another replica's stray of
        # the same microbatch from `unclaimed`.
        strays = [
            (stage, r, stray)
            for stage, r, _, never in split
            if (stray := ledger.unclaimed(stage, never, among))
        ]
        voided = {(stage, r.peer) for stage, r, _ in strays}
        for stage, r, adoptable, _ in split:
            if adoptable and (stage, r.peer) not in voided:  # one voided anyway adopts none
                self._adopt(ledger, stage, r, adoptable, among)
        for stage, r, stray in strays:
            log.warning(
                "step %d: %s holds late receipts %s at stage %d %s: voided, its step there "
                "replayed",
                ledger.step,
                r.peer,
                stray,
                stage,
                "under another run than their leases'" if self.adopts else "that name no run",
            )
            await self.void(ledger, stage, r.peer)
        return voided

    def _named(
        self,
        ledger: StepLedger,
        returned: list[int],
        pairs: list[tuple[int, Replica]],
        infos: list[pb.StageInfoResponse | BaseException],
        voided: set[tuple[int, str]],
    ) -> dict[int, dict[int, set[str]]]:
        """Which of `returned` members name in flight (index -> stage -> peers): pushes under
        the run of the lease given back (any where it named none), at a stage the ledger still
        needs them, of a replica not `voided` by this check; none where the rules adopt no late
        receipt (it would void its replica all the same, later)."""
        among, named = set(returned), dict[int, dict[int, set[str]]]()
        if not self.adopts:
            return named
        for (stage, r), info in zip(pairs, infos, strict=True):
            if isinstance(info, BaseException) or (stage, r.peer) in voided:
                continue
            for f in info.in_flight:
                ours = f.step == ledger.step and ledger.run_of(f.index) in (None, f.run)
                if ours and ledger.unclaimed(stage, [f.index], among):
                    named.setdefault(f.index, {}).setdefault(stage, set()).add(r.peer)
        return named

    def _split(self, ledger: StepLedger, runs: dict[int, int]) -> tuple[list[int], list[int]]:
        """A replica's receipts (index -> run) as (those that may be adopted, those never
        adopted): never one under another run than the one its microbatch's last lease was
        signed with (a push that lease did not send; an unsigned lease's run is its trainer's,
        any), nor any where the rules adopt none."""
        adoptable: list[int] = []
        never: list[int] = []
        for index, run in runs.items():
            leased = ledger.run_of(index)
            other = leased is not None and run != leased
            (never if not self.adopts or other else adoptable).append(index)
        return adoptable, never

    def _adopt(
        self, ledger: StepLedger, stage: int, r: Replica, receipts: list[int], among: set[int]
    ) -> None:
        adopted = ledger.adopt(stage, r.peer, receipts, among, self.size)
        if adopted:
            log.info(
                "step %d: %s's late receipts %s at stage %d adopted",
                ledger.step,
                r.peer,
                adopted,
                stage,
            )
