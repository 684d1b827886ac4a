"""The coordinator's side of lease tickets (`swarm.net.lease_tickets`): each task it leases goes
out with the scheduler's ticket of its microbatch at each stage it accumulates at, which the
lessee's accumulating call there carries and the replicas the scheduler placed ask for.

On the push plane a task is leased with the run it is pushed as (`Task.run`), drawn here and
named by its tickets: a replica on the push's route holds the tickets of the stages after its
own, and with a run of its own could accumulate the microbatch at one of them ahead of the
lessee's push, whose record there (its run's) would then not be what that replica accumulated,
and its contribution's audit, redone from that run's records, would frame it. A run is drawn
where the job's pushes keep records for its audits and some stage has a second replica to
redo its work, or the task carries contribution audits; else 0, and no replica keeps one (issue
69: nothing paid for an audit that cannot run). That was the trainer's own choice
(`PushAudits.run_id`), which it still makes for a task no scheduler signed."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence

from swarm.net.commit_auth import SchedulerKey
from swarm.rpc.lease import Replica, Task

__all__ = ["LeaseSigner"]


class LeaseSigner:
    """Signs the tasks of `job_id` with `key` (None: no scheduler, `swarm trainer
    --stage-servers`, whose replicas take the token alone: tasks go unsigned). `records`: the
    job's pushes keep records for its audits (the push plane, audited)."""

    def __init__(self, job_id: str, key: SchedulerKey | None, records: bool = False) -> None:
        self.job_id, self.key, self.records = job_id, key, records

    def signed(self, tasks: list[Task], members: Sequence[Sequence[Replica]] = ()) -> list[Task]:
        """`tasks`, stamped with their epoch and given their audits already, each with its run
        (where `members`, the replicas of each stage, hold a second one somewhere, or it carries
        audits) and its tickets: one for each stage it accumulates at (a replay's, some),
        indexed by stage. A validation task accumulates nothing: it needs none."""
        second = any(len(stage) > 1 for stage in members)
        return [t if t.evaluate or self.key is None else self._ticketed(t, second) for t in tasks]

    def _ticketed(self, task: Task, second: bool) -> Task:
        key, top = self.key, max(task.stages, default=-1)
        assert key is not None
        recorded = self.records and (second or bool(task.audits))
        run = secrets.randbits(63) | 1 if recorded else 0  # never 0 where records are kept
        tickets = tuple(
            key.lease_ticket(self.job_id, task.step, task.index, task.epoch, stage, run)
            if stage in task.stages
            else b""
            for stage in range(top + 1)
        )
        return dataclasses.replace(task, tickets=tickets, run=run)
