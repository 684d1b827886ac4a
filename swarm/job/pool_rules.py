"""Which rule a job's pools follow, read off its job file: whether a stage's replicas differ
between rounds, how many steps a round is, and whether a step computes on parameters one update
old. Every role asks here (the replicas, the coordinator, the trainer, the reference), so they
agree on the schedule without each spelling it out."""

from __future__ import annotations

from swarm.job.config import JobConfig

__all__ = ["delays", "has_rounds", "round_steps", "step_eager"]


def step_eager(job: JobConfig) -> bool:
    """delayed_update's eager rule (`pool.mode = "step"`, `overlap = "eager"`): the swarm runs
    it as rounds of one step (`has_rounds`) whose outer step is the job's optimizer on the
    step's eager gradient, so no step computes on parameters one update old (`delays`)."""
    return job.pool.mode == "step" and job.pool.overlap == "eager"


def has_rounds(job: JobConfig) -> bool:
    """Whether a stage's replicas differ between rounds (`pool.mode = "local"`, or
    `step_eager`): each applies its own part of a step, and the pools meet at round ends."""
    return job.pool.mode == "local" or step_eager(job)


def round_steps(job: JobConfig) -> int:
    """Steps per round where `has_rounds`: `pool.sync_every`, or one (`step_eager`)."""
    return 1 if step_eager(job) else job.pool.sync_every


def delays(job: JobConfig) -> bool:
    """Whether step t+1 computes on the parameters before step t's update (delayed_update's
    plain rule; its eager rule applies each step at once and delays only the others' shares)."""
    return job.training.delayed_update and not step_eager(job)
