"""`swarm trainer` with explicit stage-server addresses: train, then optionally save the model."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from client.trainer import PipelineTrainer
from swarm.config import JobConfig
from swarm.metrics import TrainerMetrics, serve_metrics
from swarm.progress import StepLog

__all__ = ["run_trainer"]

log = logging.getLogger(__name__)


async def run_trainer(
    job: JobConfig,
    addresses: list[str],
    *,
    out: Path | None = None,
    log_path: Path | None = None,
    threads: int = 1,
    metrics_port: int | None = None,
    show_progress: bool = True,
) -> int:
    torch.set_num_threads(max(1, threads))
    metrics = TrainerMetrics(job.fingerprint())
    if metrics_port is not None:
        serve_metrics(metrics.registry, "127.0.0.1", metrics_port)
    trainer = PipelineTrainer(job, addresses, metrics=metrics)
    try:
        first = await trainer.check_servers()
        with StepLog(
            job.training.steps,
            path=log_path,
            desc=f"swarm {job.name}",
            initial=first,
            show=show_progress,
        ) as steps:
            await trainer.train(on_step=steps)
        if out:
            torch.save(await trainer.state_dict(), out)
            print(f"wrote {out}")
    finally:
        await trainer.close()
    return 0
