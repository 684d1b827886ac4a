"""The rollback epoch a stage call is made in: the coordinator's, as it was when the task the
call serves was leased (`Task.epoch`).

A rollback loads one state on every replica and reopens the step it rolls back to; a trainer
may still run a task leased before it. Were that task's calls to land after the load, they
would be work of the same `(step, index)` as the replayed step's own: added to its sums (and
the replay's own copy answered as a duplicate), they would put into the step a gradient taken
on the state before the rollback, perhaps through the peer whose ban caused it. So each
microbatch's id carries the epoch (`MicrobatchId.epoch`), a rollback's LoadState the new one
(and the coordinator's Join too: a replica that joins after a rollback loaded none of its
state), and a replica refuses work of an older epoch than it has seen (`Sums.admit`).

The trainer sets it once per task (`leased_in`); the stage client reads it for each call,
rather than every hop, audit and replay passing it along. Each task runs in its own asyncio
task, whose context is its own: one task's epoch does not leak into another's."""

from __future__ import annotations

from contextvars import ContextVar

__all__ = ["current", "leased_in"]

_EPOCH: ContextVar[int] = ContextVar("rollback_epoch", default=0)


def leased_in(epoch: int) -> None:
    """The calls the current asyncio task makes from now on serve work leased in `epoch`."""
    _EPOCH.set(epoch)


def current() -> int:
    """The epoch of the work the current asyncio task's calls serve (0: before any rollback)."""
    return _EPOCH.get()
