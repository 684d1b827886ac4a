"""The seam between the trainer and how a microbatch travels (`DataPlane`), and the choice of
plane a job names (`runtime.data_plane`). The trainer leases, reports and follows membership;
a plane runs one task and says, per stage, which replica surely accumulated it. `make_plane`
is the composition point of the planes and the trainer's audits (`client.audit`): no other
module of `client.data_plane` imports them (tests/test_layering.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from client.audit.audited import Audited
from client.audit.audits import Audits, tolerance_of
from client.audit.late_audits import LateReport
from client.audit.push_audit import PushAudits
from client.audit.reexecute import StageReexecutor
from client.data_plane.boundary_cache import BoundaryCache
from client.data_plane.carry import CarryPlane
from client.data_plane.hops import StageHops
from client.data_plane.push import PushPlane, Unaudited
from client.metrics import TrainerMetrics
from swarm.job.config import JobConfig
from swarm.job.rule import rule_of
from swarm.model.data import DataSource
from swarm.rpc.lease import MicrobatchResult, Replica, Task

__all__ = ["DataPlane", "make_plane"]


class DataPlane(Protocol):
    def follow(self, replicas: Sequence[Sequence[Replica]]) -> None:
        """The coordinator's view of every stage's members changed (`Routes` already follows
        it; a plane keeps what else it derives from it)."""

    async def train(self, task: Task, data: DataSource) -> MicrobatchResult:
        """Run training task `task` (microbatch `(step, index)` of `data`); the result holds
        the replicas that surely accumulated it at each of `task.stages` (a stage left out is
        settled by the coordinator: it adopts a late receipt or replays)."""
        ...

    async def evaluate(
        self, task: Task, ids: torch.Tensor, labels: torch.Tensor
    ) -> MicrobatchResult:
        """Run validation task `task` on `ids` forward only, its loss reported; nothing
        accumulates, so any failed hop is simply tried elsewhere."""
        ...

    async def stop(self) -> None:
        """The trainer shuts down: what the plane still runs past its microbatches' reports
        (the push plane's late audits) is cancelled, and has ended on return."""
        ...


def make_plane(
    job: JobConfig, hops: StageHops, metrics: TrainerMetrics, report: LateReport | None = None
) -> DataPlane:
    """The plane `job` names, audited where the job audits: the one place the data planes and
    the trainer's audits (`client.audit`) are put together. `report`: where a push-plane audit
    that ends after its microbatch's report sends what it found (`client.audit.late_audits`;
    None: each microbatch waits for its audit)."""
    audits = audits_of(job, hops, metrics)
    if job.runtime.data_plane == "push":
        pushed = Unaudited() if audits is None else PushAudits(job, audits, hops.routes, report)
        return PushPlane(job, hops, metrics, pushed)
    cache = BoundaryCache(job.runtime.boundary_cache_bytes, delays=rule_of(job).delays)
    plane = CarryPlane(job, hops, metrics, cache)
    return plane if audits is None else Audited(plane, cache, audits, job.training.stages)


def audits_of(job: JobConfig, hops: StageHops, metrics: TrainerMetrics) -> Audits | None:
    """Either plane's audits (`[trust] audit_fraction`); none under local steps, whose
    replicas hold different parameters between rounds, so no other can redo their work."""
    if not job.trust.audit_fraction or rule_of(job).rounds:
        return None
    reexecutor = StageReexecutor(job, hops.routes)
    return Audits(job.trust.audit_fraction, tolerance_of(job), reexecutor, metrics)
