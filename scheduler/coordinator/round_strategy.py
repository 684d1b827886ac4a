"""The coordinator's rounds: one strategy per job, chosen once from its rule (`rounds_of`), so
that neither the step's lifecycle (`coordinator`) nor its commit (`commit`) asks which rule the
job trains by. `NoRounds` is the plain rules' (sync, delayed: every step is its own commit and
every replica of a stage holds the same state); `PoolRounds` (`rounds`) the local rule's, where
each replica applies its own steps and its pool averages at each round's end; `EagerRounds`
(`eager_rounds`) the eager rules' (local-eager, step-eager), whose averaging overlaps the next
round."""

from __future__ import annotations

from typing import Protocol

from scheduler.coordinator.eager_rounds import EagerRounds
from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.round_context import RoundContext
from scheduler.coordinator.rounds import PoolRounds
from swarm.proto import scheduler_pb2 as spb
from swarm.rpc.lease import Replica

__all__ = ["NoRounds", "Rounds", "rounds_of"]


class Rounds(Protocol):
    """What the coordinator and the commit ask of the job's rounds."""

    @property
    def readmits(self) -> bool:
        """Whether a member dropped for a missed deadline may be taken back as it is (else it
        holds a round its pool ended without it: not the stage's state)."""
        ...

    @property
    def adopts_late_receipts(self) -> bool:
        """Whether a late receipt is adopted where it landed (else it names no run for the
        route record: the replica holding it is voided before the microbatch is replayed)."""
        ...

    async def started(self, step: int, members: list[list[Replica]]) -> None:
        """The job starts (or resumes) at `step` with `members`."""
        ...

    def can_admit(self, step: int) -> bool:
        """Whether a copy may join at `step` as far as the rounds go."""
        ...

    def admit_on_open(self, step: int) -> bool:
        """Whether the copies waiting to join are asked as `step` opens (and admitted if they
        are at it): their own asks pause for up to seconds, and could miss the moments they
        may join at for many steps (steps are short)."""
        ...

    async def whole(self, step: int) -> None:
        """Every member's state whole at `step` (a checkpoint, a copy about to join need it)."""
        ...

    def joined(self, step: int, stage: int, peer: str, source: str) -> None:
        """`peer` became a member of `stage` at `step`, a copy of `source`."""
        ...

    def step_pool(
        self, ledger: StepLedger, stage: int, r: Replica, group: list[str], index: int, total: int
    ) -> tuple[int, list[str], int]:
        """Whom `r`'s PREPARE of `ledger`'s step averages with, given its pool (`group`, `r`
        at `index`) and the step's `total` samples: (samples, group, index)."""
        ...

    async def applied(self, ledger: StepLedger) -> None:
        """`ledger`'s step is applied on every member: the round it ends, if any, ends now."""
        ...

    def restarted(self) -> None:
        """Every member holds the same state anew (a start, a rollback)."""
        ...

    def cancel(self) -> None:
        """The coordinator closes (or rolls back): work in the background stops."""
        ...

    def status(self, done: int) -> spb.RoundStatus | None:
        """What `swarm status` says of the rounds after `done` committed steps (None: none)."""
        ...


class NoRounds:
    """The plain rules' (sync, delayed): a step's PREPARE averages the pool, and nothing more
    happens between steps."""

    readmits = True
    adopts_late_receipts = True

    async def started(self, step: int, members: list[list[Replica]]) -> None:
        pass

    def can_admit(self, step: int) -> bool:
        return True

    def admit_on_open(self, step: int) -> bool:
        # A copy may join at any step: asked as each opens, it joins at the first step its copy
        # reaches (and one whose source died is named another there), not at its own next ask.
        return True

    async def whole(self, step: int) -> None:
        pass

    def joined(self, step: int, stage: int, peer: str, source: str) -> None:
        pass

    def step_pool(
        self, ledger: StepLedger, stage: int, r: Replica, group: list[str], index: int, total: int
    ) -> tuple[int, list[str], int]:
        return total, group, index

    async def applied(self, ledger: StepLedger) -> None:
        pass

    def restarted(self) -> None:
        pass

    def cancel(self) -> None:
        pass

    def status(self, done: int) -> spb.RoundStatus | None:
        return None


def rounds_of(context: RoundContext) -> Rounds:
    """The rounds of `context.job`, whose rule is `context.rule`."""
    if not context.rule.rounds:
        return NoRounds()
    kind = EagerRounds if context.rule.eager else PoolRounds
    return kind(context)
