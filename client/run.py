"""`swarm trainer` with explicit stage-server addresses: this process coordinates the steps itself,
trains, then optionally saves the model."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import torch

from client.coordinator import LocalCoordinator, Replica
from client.trainer import PipelineTrainer
from swarm.config import JobConfig
from swarm.metrics import TrainerMetrics, serve_metrics
from swarm.progress import StepLog

__all__ = ["gather_state", "parse_stage_servers", "run_trainer"]

log = logging.getLogger(__name__)


def parse_stage_servers(text: str) -> list[list[Replica]]:
    """`a,b|c,d`: stages separated by ",", a stage's replicas by "|"."""
    return [
        [Replica(a.strip(), a.strip()) for a in stage.split("|") if a.strip()]
        for stage in text.split(",")
        if stage.strip()
    ]


async def gather_state(coordinator: LocalCoordinator) -> dict[str, torch.Tensor]:
    """The whole model, from one replica of each stage."""
    state: dict[str, torch.Tensor] = {}
    for stage, replicas in enumerate(coordinator.replicas()):
        _step, part = await coordinator.client(stage, replicas[0]).download_state()
        state.update(part)
    return state


async def run_trainer(
    job: JobConfig,
    replicas: list[list[Replica]],
    *,
    out: Path | None = None,
    log_path: Path | None = None,
    threads: int = 1,
    metrics_port: int | None = None,
    show_progress: bool = True,
    token: str | None = None,
) -> int:
    if len(replicas) != job.training.stages:
        raise SystemExit(
            f"the job has {job.training.stages} stages; --stage-servers names {len(replicas)}"
        )
    torch.set_num_threads(max(1, threads))
    metrics = TrainerMetrics(job.fingerprint())
    if metrics_port is not None:
        serve_metrics(metrics.registry, "127.0.0.1", metrics_port)
    steps = StepLog(job.training.steps, path=log_path, desc=f"swarm {job.name}", show=show_progress)
    coordinator = LocalCoordinator(
        job, job.fingerprint(), lambda: replicas, token=token, on_step=steps
    )
    trainer = PipelineTrainer(job, coordinator, metrics=metrics, token=token)
    try:
        with steps:
            first = await coordinator.start()
            steps.advance_to(first)
            await asyncio.gather(trainer.run(), coordinator.finished.wait())
        if coordinator.error:
            raise coordinator.error
        if out:
            torch.save(await gather_state(coordinator), out)
            print(f"wrote {out}")
    finally:
        await trainer.close()
        await coordinator.close()
    return 0
