"""What the scheduler's job API (`scheduler.job_api`) asks of the orchestration: `JobControl`,
which the scheduler (`scheduler.service.Scheduler`) implements and the API's tests fake."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from swarm.proto import scheduler_pb2
from swarm.rpc.lease import Lease, MicrobatchResult, Working

__all__ = ["JobControl"]


class JobControl(Protocol):
    """What the job API needs from the orchestration. Called on the event loop's thread; the
    sync methods must not block. The store is the truth: `submitted` and `cancelled` are called
    after the store has recorded the change."""

    def submitted(self, job_id: str) -> None:
        """A new job was stored (queued): place and train it."""

    def cancelled(self, job_id: str) -> None:
        """The job is now cancelled in the store: stop training it, release its peers."""

    async def delete(self, job_id: str) -> None:
        """Remove what the orchestration keeps of a finished job (its checkpoints and final model,
        off the event loop); the job API then deletes its record. FailedPrecondition for an
        unfinished job."""

    def stages(self, job_id: str) -> list[scheduler_pb2.StageStatus]:
        """Replicas per stage now (asked for unfinished jobs only)."""
        ...

    def samples_per_second(self, job_id: str) -> float:
        """Recent training throughput (asked for unfinished jobs only)."""
        ...

    def health(self, job_id: str) -> tuple[float, list[str]]:
        """Since when the job has waited for what its message says (unix seconds, 0: it does
        not wait), and the risks to warn of (asked for unfinished jobs only)."""
        ...

    def rounds(self, job_id: str, step: int) -> scheduler_pb2.RoundStatus | None:
        """Its rounds after `step` committed steps, where its pools meet in rounds and it
        trains now (asked for unfinished jobs only)."""
        ...

    async def lease(
        self,
        job_id: str,
        trainer: str,
        count: int,
        *,
        wait_s: float = 0.0,
        working: Sequence[Working] = (),
    ) -> Lease:
        """The step coordinator's `lease` (a long poll of at most `wait_s`; renews `working`)."""
        ...

    async def report(
        self,
        job_id: str,
        trainer: str,
        results: list[MicrobatchResult],
        released: list[int],
        failure: str | None = None,
    ) -> None:
        """The step coordinator's `report` of each result, and its `release` of `released`
        with why they failed (`failure`: the trainer's word, for the job's status)."""
        ...

    async def export(self, job_id: str) -> tuple[int, dict[str, torch.Tensor]]:
        """(step, the whole model's state_dict) of one committed step. Raise FailedPrecondition
        with a message saying why when impossible (e.g. a stage has no replica and no checkpoint).
        """
        ...

    def routes(self, job_id: str) -> Path:
        """Where the job's route record lies (pool.mode = "local"); it may not exist."""
        ...
