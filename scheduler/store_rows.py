"""The job store's rows as its callers read them (`scheduler.store`): a job, one of its events,
one of its step records."""

from __future__ import annotations

import math
from dataclasses import dataclass

from swarm.job.states import TERMINAL, JobState

__all__ = ["EventRow", "JobRecord", "StepRow"]


@dataclass(frozen=True)
class JobRecord:
    id: str
    name: str
    spec: str  #: the job file's TOML text as submitted
    base_dir: str  #: absolute directory relative data paths resolve against
    state: JobState
    step: int  #: committed steps so far (the next step to train)
    steps: int  #: steps to train in total
    loss: float  #: loss of the last committed step; NaN before the first
    error: str  #: why, when failed ("" otherwise)
    message: str  #: what it is doing or waiting for, for people
    created: float  #: unix seconds
    updated: float  #: unix seconds
    first_loss: float = math.nan  #: loss of step 0; NaN before it
    val_loss: float = math.nan  #: validation loss at the newest evaluation; NaN before one
    val_step: int = -1  #: the updates the evaluated parameters had; -1 before an evaluation
    submitter: str = ""  #: who submitted it (`scheduler.callers`); "": the swarm token alone
    samples_done: int = 0  #: samples over its recorded steps
    seconds_done: float = 0.0  #: seconds over its recorded steps

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL

    @property
    def mean_speed(self) -> float:
        """Samples per second over its recorded steps (0 before the first)."""
        return self.samples_done / self.seconds_done if self.seconds_done else 0.0


@dataclass(frozen=True)
class EventRow:
    time: float  #: unix seconds
    kind: str  #: join, leave, restart, move, replay, stall, resume, rollback, state, checkpoint
    text: str  #: for people


@dataclass(frozen=True)
class StepRow:
    job: str
    step: int
    loss: float  #: mean loss over the step's samples (NaN if it was NaN)
    samples: int  #: samples the step consumed
    seconds: float  #: wall time of the step
    time: float  #: unix seconds of the commit
