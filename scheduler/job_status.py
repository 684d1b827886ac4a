"""A job's wire form (`JobStatus`): the stored record, and while it runs what the orchestration
knows of it (`LiveJobs`: a narrower thing than what the job API drives, `JobControl`). Apart
from the job API (`scheduler.job_api`), which answers it, so that each keeps to one concept."""

from __future__ import annotations

from typing import Protocol

from scheduler.store import Events, JobRecord
from swarm.job.states import job_state_proto
from swarm.proto import scheduler_pb2

__all__ = ["LiveJobs", "job_status"]


class LiveJobs(Protocol):
    """What a job's status reads of the orchestration (`scheduler.job_control.JobControl`'s)."""

    def stages(self, job_id: str) -> list[scheduler_pb2.StageStatus]: ...

    def samples_per_second(self, job_id: str) -> float: ...

    def health(self, job_id: str) -> tuple[float, list[str]]: ...

    def rounds(self, job_id: str, step: int) -> scheduler_pb2.RoundStatus | None: ...


def job_status(
    record: JobRecord,
    control: LiveJobs,
    events: Events | None = None,
    mean_speed: float = 0.0,
) -> scheduler_pb2.JobStatus:
    """The wire form of a job: the stored record plus, while it runs, the live stages, speed,
    waiting and warnings; `events`: its newest events (GetJob's); `mean_speed`: an ended job's
    samples/s over its steps."""
    live = not record.finished
    waiting_since, warnings = control.health(record.id) if live else (0.0, [])
    return scheduler_pb2.JobStatus(
        job=record.id,
        name=record.name,
        state=job_state_proto(record.state),
        step=record.step,
        steps=record.steps,
        loss=record.loss,  # NaN before the first step
        first_loss=record.first_loss,
        val_loss=record.val_loss if record.val_step >= 0 else None,
        val_step=max(record.val_step, 0),
        error=record.error,
        message=record.message,
        stages=control.stages(record.id) if live else [],
        samples_per_second=control.samples_per_second(record.id) if live else mean_speed,
        waiting_since=waiting_since,
        warnings=warnings,
        rounds=control.rounds(record.id, record.step) if live else None,
        events=[
            scheduler_pb2.JobEvent(time=e.time, kind=e.kind, text=e.text) for e in events or []
        ],
        created=record.created,
        updated=record.updated,
        spec=record.spec,
        base_dir=record.base_dir,
        submitter=record.submitter,
    )
