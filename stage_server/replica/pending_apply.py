"""A call of step t+1 that reaches a replica between its PREPARE of step t and that step's APPLY
waits for the APPLY, rather than being refused as a step not started here (issue 69).

Why it can come: on the synchronous plain rule the coordinator opens step t+1 as soon as step t
is decided, that is once every replica answered its PREPARE and the APPLYs are sent
(`scheduler.coordinator.live_steps.SyncSteps`), not once every APPLY answered. The next step's
first push then races the APPLYs: it may reach a stage (stage 0 from the trainer, or a later
stage from the one before it) before that stage's APPLY has landed. Waiting keeps the step
exact (its forward computes on the updated parameters, as before) and takes the APPLY's answer,
the coordinator's bookkeeping, the lease and the push off the step's critical path.

Only a replica that answered the PREPARE of the step before waits (what `due` says): a decided
step's APPLY is on its way to it. Any other call of a step not started here is refused at once,
as before. The wait is bounded by the APPLY call's own deadline (the job's `rpc_timeout_s`):
past it no APPLY will land (the coordinator gave up on this replica, which rejoins later), and
the call is refused as before, by the runtime's own check, with a warning saying why."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from swarm.deadline import within

__all__ = ["PendingApply"]

log = logging.getLogger(__name__)


class PendingApply:
    """Where a replica's calls of the next step wait for its APPLY."""

    # A waiting call looks again this often, whatever it was told: a replica's step may also
    # move by a state loaded (a rollback's, a copy's), which tells nobody here.
    RECHECK_S = 0.25

    def __init__(self) -> None:
        self._moved = asyncio.Event()  # set (and replaced) when the replica's step may have moved

    def moved(self) -> None:
        """The replica applied a step or dropped what it prepared: waiting calls look again."""
        self._moved.set()
        self._moved = asyncio.Event()

    async def wait(self, due: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Return once `due()` is false (the APPLY landed, or what was prepared is gone), or
        after `timeout_s` (logged): `what` names the call and the step it waits for."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while due():
            left = deadline - loop.time()
            if left <= 0:
                log.warning(
                    "%s waited %.0f s for its step's APPLY, which did not come: refused",
                    what,
                    timeout_s,
                )
                return
            moved = self._moved  # before waiting: a move after the look wakes this wait
            try:
                await within(moved.wait(), min(left, self.RECHECK_S))
            except TimeoutError:
                continue
