"""Whether a stage call is made by a late audit: one whose microbatch was reported already
(issue 69 item 4, `client.audit.late_audits`), so that its re-executions say so
(`StageForwardRequest.late` and the Backward's and ForwardBackward's).

The auditor runs an audit's re-execution ahead of the pushes queued at it where the audit gates
its microbatch's report (the step's commit waits for it), and in turn with them where it is late
(its bound a step away: ahead, it would hold up the pushes of the step being trained;
`stage_server.replica.answering`). Only the trainer knows which: the request's step against the
auditor's does not tell, as most late re-executions reach an auditor still at their step.

The trainer marks each late audit's asyncio task once (`in_late_audit`); the stage client reads it
for each call, rather than every audit and re-execution passing it along, as the rollback epoch
(`swarm.rpc.epoch`). A task's context is its own (and its children's, copied as they start): a
late audit's mark does not leak into the pushes or the audits that gate."""

from __future__ import annotations

from contextvars import ContextVar

__all__ = ["current", "in_late_audit"]

_LATE: ContextVar[bool] = ContextVar("late_audit", default=False)


def in_late_audit() -> None:
    """The calls the current asyncio task (and the tasks it starts) makes from now on are a late
    audit's."""
    _LATE.set(True)


def current() -> bool:
    """Whether the current asyncio task's calls are a late audit's."""
    return _LATE.get()
