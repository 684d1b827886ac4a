"""The coordinator's side of lease tickets (`swarm.net.lease_tickets`): each task it leases goes
out with the scheduler's ticket of its microbatch at each stage it accumulates at, which the
lessee's accumulating call there carries and the replicas the scheduler placed ask for."""

from __future__ import annotations

import dataclasses

from swarm.net.commit_auth import SchedulerKey
from swarm.rpc.lease import Task

__all__ = ["LeaseSigner"]


class LeaseSigner:
    """Signs the tasks of `job_id` with `key` (None: no scheduler, `swarm trainer
    --stage-servers`, whose replicas take the token alone: tasks go unsigned)."""

    def __init__(self, job_id: str, key: SchedulerKey | None) -> None:
        self.job_id, self.key = job_id, key

    def signed(self, tasks: list[Task]) -> list[Task]:
        """`tasks`, stamped with their epoch already, each with its tickets: one for each stage
        it accumulates at (a replay's, some), indexed by stage. A validation task accumulates
        nothing: it needs none."""
        return [t if t.evaluate or self.key is None else self._ticketed(t) for t in tasks]

    def _ticketed(self, task: Task) -> Task:
        key, top = self.key, max(task.stages, default=-1)
        assert key is not None
        tickets = tuple(
            key.lease_ticket(self.job_id, task.step, task.index, task.epoch, stage)
            if stage in task.stages
            else b""
            for stage in range(top + 1)
        )
        return dataclasses.replace(task, tickets=tickets)
