"""The lease a stage call serves: the rollback epoch it was leased in and its tickets, as the
coordinator gave them with the task (`Task.epoch`, `Task.tickets`).

A rollback loads one state on every replica and reopens the step it rolls back to; a trainer
may still run a task leased before it. Were that task's calls to land after the load, they
would be work of the same `(step, index)` as the replayed step's own: added to its sums (and
the replay's own copy answered as a duplicate), they would put into the step a gradient taken
on the state before the rollback, perhaps through the peer whose ban caused it. So each
microbatch's id carries the epoch (`MicrobatchId.epoch`), a rollback's LoadState the new one
(and the coordinator's Join too: a replica that joins after a rollback loaded none of its
state), and a replica refuses work of an older epoch than it has seen (`Sums.admit`).

An accumulating call carries its stage's lease ticket too (`MicrobatchId.ticket`; a push all of
them, `StagePushRequest.tickets`): a replica the scheduler placed accumulates a microbatch only
with it (`swarm.net.lease_tickets`). No other call carries one: a replica that forwards a
microbatch, or redoes it for an audit, does not learn what would let it accumulate it elsewhere.

The trainer sets them once per task (`leased_in`); the stage client reads them for each call,
rather than every hop, audit and replay passing them along. Each task runs in its own asyncio
task, whose context is its own: one task's lease does not leak into another's."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from contextvars import ContextVar

from swarm.proto import stage_pb2 as pb

__all__ = ["current", "leased_in", "microbatch_id", "push_tickets", "tickets"]

_LEASE: ContextVar[tuple[int, tuple[bytes, ...]]] = ContextVar("lease", default=(0, ()))


def leased_in(epoch: int, tickets: Sequence[bytes] = ()) -> None:
    """The calls the current asyncio task makes from now on serve work leased in `epoch`, under
    the scheduler's lease `tickets` (indexed by stage; b"" or none: no scheduler leased it)."""
    _LEASE.set((epoch, tuple(tickets)))


def current() -> int:
    """The epoch of the work the current asyncio task's calls serve (0: before any rollback)."""
    return _LEASE.get()[0]


def tickets() -> tuple[bytes, ...]:
    """The lease tickets of the work the current asyncio task's calls serve, by stage."""
    return _LEASE.get()[1]


def push_tickets(accumulate: Collection[int]) -> list[bytes]:
    """What a push carries on (`StagePushRequest.tickets`): the tickets of the stages in its
    `accumulate`, by stage, and none of another (b""): a replica it goes through learns no
    earlier stage's, nor one of a stage it does not accumulate at. Empty where it accumulates
    nowhere."""
    held = tickets()
    top = min(len(held), max(accumulate, default=-1) + 1)
    return [held[k] if k in accumulate else b"" for k in range(top)]


def microbatch_id(step: int, index: int, accumulating_at: int | None = None) -> pb.MicrobatchId:
    """The id a call of the current task names microbatch `(step, index)` by: its epoch, and,
    for a call that accumulates at stage `accumulating_at`, that stage's ticket alone."""
    ticket = b""
    if accumulating_at is not None:
        held = tickets()
        ticket = held[accumulating_at] if accumulating_at < len(held) else b""
    return pb.MicrobatchId(step=step, index=index, epoch=current(), ticket=ticket)
