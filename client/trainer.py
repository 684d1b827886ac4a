"""The trainer: drives each step's microbatches through the stages and commits the step.

Microbatch `(step, index)` goes forward through stages 0..S-2, forward-and-backward at S-1, then
backward through S-2..0, keeping up to `runtime.max_in_flight` microbatches in flight. The trainer
keeps, per microbatch and stage, the receipt of the replica that holds its gradient; when every
microbatch has a receipt at every stage, the step is committed on each stage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from client.stage_client import StageClient
from swarm.config import JobConfig
from swarm.data import DataSource, make_data
from swarm.errors import SwarmError
from swarm.metrics import TrainerMetrics
from swarm.progress import StepRecord

__all__ = ["PipelineTrainer", "TrainerError"]

log = logging.getLogger(__name__)


class TrainerError(SwarmError):
    """A microbatch or commit failed and cannot be completed."""


@dataclass
class _StepState:
    receipts: list[dict[int, int]] = field(default_factory=list)  # per stage: index -> samples
    loss_sum: float = 0.0


class PipelineTrainer:
    """One replica per stage (pools and rerouting build on this in later layers)."""

    def __init__(
        self,
        job: JobConfig,
        addresses: Sequence[str],
        *,
        data: DataSource | None = None,
        metrics: TrainerMetrics | None = None,
        job_id: str | None = None,
        token: str | None = None,
    ) -> None:
        if len(addresses) != job.training.stages:
            raise TrainerError(
                f"the job has {job.training.stages} stages; got {len(addresses)} stage servers"
            )
        # Standalone servers know a job by its fingerprint; a scheduler names it by its job id.
        self.job, self.job_id = job, job_id or job.fingerprint()
        self.clients = [StageClient(a, job, self.job_id, k, token) for k, a in enumerate(addresses)]
        self.data = data or make_data(job)
        self.metrics = metrics or TrainerMetrics(self.job_id)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))

    async def check_servers(self) -> int:
        """Ask each server what it serves and bring them to one step; returns that step.

        A trainer that died between committing some stages and the rest leaves the laggards one
        step behind, each still holding every receipt of that step (a commit is only sent once all
        receipts exist): committing those receipts finishes the step exactly. Any other mismatch is
        an error."""
        infos = await asyncio.gather(*(c.info() for c in self.clients))
        for k, info in enumerate(infos):
            if info.job != self.job_id or info.stage != k:
                raise TrainerError(
                    f"{self.clients[k].address} serves job {info.job!r} stage {info.stage}; "
                    f"expected job {self.job_id!r} stage {k} (same job file on both sides?)"
                )
        steps = sorted({info.step for info in infos})
        if len(steps) == 1:
            return steps[0]
        m, mb = self.job.training.microbatches_per_step, self.job.training.microbatch_size
        behind = [k for k, info in enumerate(infos) if info.step == steps[0]]
        if (
            len(steps) > 2
            or steps[1] != steps[0] + 1
            or any(len(infos[k].receipts) != m for k in behind)
        ):
            raise TrainerError(f"stage servers disagree on the step: {[i.step for i in infos]}")
        log.warning("finishing step %d's commit on stages %s", steps[0], behind)
        await asyncio.gather(
            *(self.clients[k].commit(steps[0], list(infos[k].receipts), m * mb) for k in behind)
        )
        return steps[1]

    async def _microbatch(self, step: int, index: int, state: _StepState) -> None:
        inputs, targets = self.data.microbatch(step, index)
        boundary = [inputs]  # the input of each stage, kept for Backward's recompute
        for client in self.clients[:-1]:
            boundary.append(await client.forward(step, index, boundary[-1]))
        last = self.clients[-1]
        result = await last.forward_backward(
            step, index, boundary[-1], targets, need_grad_inputs=len(self.clients) > 1
        )
        self._record(state, len(self.clients) - 1, result.receipt)
        state.loss_sum += result.loss_sum
        grad = result.grad_inputs
        for k in range(len(self.clients) - 2, -1, -1):
            assert grad is not None
            result = await self.clients[k].backward(
                step, index, boundary[k], grad, need_grad_inputs=k > 0
            )
            self._record(state, k, result.receipt)
            grad = result.grad_inputs

    @staticmethod
    def _record(state: _StepState, stage: int, receipt: object) -> None:
        state.receipts[stage][receipt.microbatch.index] = receipt.samples  # type: ignore[attr-defined]

    async def run_step(self, step: int) -> StepRecord:
        start = time.perf_counter()
        m = self.job.training.microbatches_per_step
        state = _StepState(receipts=[{} for _ in self.clients])
        limit = asyncio.Semaphore(self.job.runtime.max_in_flight)

        async def one(index: int) -> None:
            async with limit:
                self.metrics.in_flight.inc()
                try:
                    await self._microbatch(step, index, state)
                finally:
                    self.metrics.in_flight.dec()
                self.metrics.microbatches.inc()

        try:
            async with asyncio.TaskGroup() as tg:
                for index in range(m):
                    tg.create_task(one(index))
        except* Exception as group:
            raise TrainerError(f"step {step}: {group.exceptions[0]}") from group.exceptions[0]
        samples = sum(state.receipts[0].values())
        if any(len(r) != m for r in state.receipts):
            raise TrainerError(
                f"step {step}: receipts incomplete: {[len(r) for r in state.receipts]}"
            )
        await asyncio.gather(
            *(
                c.commit(step, sorted(state.receipts[k]), samples)
                for k, c in enumerate(self.clients)
            )
        )
        result = StepRecord(step, state.loss_sum / samples, samples, time.perf_counter() - start)
        self.metrics.samples.inc(samples)
        self.metrics.step.set(step + 1)
        self.metrics.loss.set(result.loss)
        self.metrics.step_seconds.observe(result.seconds)
        return result

    async def train(
        self, steps: int | None = None, on_step: Callable[[StepRecord], None] | None = None
    ) -> list[StepRecord]:
        """Train from the servers' current step up to `steps` (the job's by default)."""
        first = await self.check_servers()
        results = []
        for step in range(first, steps if steps is not None else self.job.training.steps):
            result = await self.run_step(step)
            log.info(
                "step %d loss %.4f %.1f samples/s", step, result.loss, result.samples_per_second
            )
            results.append(result)
            if on_step:
                on_step(result)
        return results

    async def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters, gathered from every stage."""
        parts = await asyncio.gather(*(c.download_state() for c in self.clients))
        state: dict[str, torch.Tensor] = {}
        for _step, part in parts:
            state.update(part)
        return state
