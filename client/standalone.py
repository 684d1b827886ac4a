"""`swarm trainer` with explicit stage-server addresses: this process coordinates the steps itself,
trains, then optionally saves the model."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from client.metrics import TrainerMetrics
from client.patience import Patience, bounded
from client.trainer import PipelineTrainer, load_followed
from scheduler.coordinator import LocalCoordinator, gather_state
from scheduler.coordinator.metrics import CoordinatorMetrics
from swarm.alongside import alongside
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.model.routes import Record, write_record
from swarm.ops.metrics import serve_metrics
from swarm.ops.model_out import ModelOut, writable
from swarm.ops.progress import StepLog, StepRecord
from swarm.rpc.lease import Replica

__all__ = [
    "parse_stage_servers",
    "run_trainer",
    "train_standalone",
]

log = logging.getLogger(__name__)


def parse_stage_servers(text: str) -> list[list[Replica]]:
    """`a,b|c,d`: stages separated by ",", a stage's replicas by "|"."""
    return [
        [Replica(a.strip(), a.strip()) for a in stage.split("|") if a.strip()]
        for stage in text.split(",")
        if stage.strip()
    ]


async def train_standalone(
    job: JobConfig,
    replicas: list[list[Replica]] | Callable[[], list[list[Replica]]],
    *,
    registry: CollectorRegistry | None = None,
    on_step: Callable[[StepRecord], object] | None = None,
    token: str | None = None,
    trainers: int = 1,
    checkpoint_dir: Path | None = None,
    broker: str | None = None,
    routes: Path | None = None,
) -> dict[str, torch.Tensor]:
    """Coordinate and train `job` on the given stage servers in this process; returns the
    trained model. `registry` receives the trainer's and coordinator's metrics. With `broker`,
    the trainers' wiring follows the load reports published there for this job (its id is
    `fingerprint(job)`) by replicas named as in `replicas`. `routes`: write pool.mode =
    "local"'s route record there (`swarm.model.routes`), for `swarm local --routes`."""
    with contextlib.ExitStack() as stack:
        record = None
        if routes is not None:
            f = stack.enter_context(open(routes, "w", encoding="utf-8"))
            record = lambda r: write_record(f, [r])  # noqa: E731
        return await _train(
            job, replicas, registry, on_step, token, trainers, checkpoint_dir, broker, record
        )


async def _train(
    job: JobConfig,
    replicas: list[list[Replica]] | Callable[[], list[list[Replica]]],
    registry: CollectorRegistry | None,
    on_step: Callable[[StepRecord], object] | None,
    token: str | None,
    trainers: int,
    checkpoint_dir: Path | None,
    broker: str | None,
    on_route: Callable[[Record], None] | None,
) -> dict[str, torch.Tensor]:
    registry = registry or CollectorRegistry()
    members = replicas if callable(replicas) else (lambda: replicas)  # type: ignore[misc]
    runs: list[PipelineTrainer] = []
    patience = Patience(
        job.runtime.patience_s,
        lambda: next((t.failure for t in runs if t.failure), None),
        lambda: coordinator.progress(),
    )

    def committed(record: StepRecord) -> object:
        patience.committed()
        return on_step(record) if on_step is not None else None

    coordinator = LocalCoordinator(
        job,
        fingerprint(job),
        members,
        token=token,
        on_step=committed,  # type: ignore[arg-type]
        metrics=CoordinatorMetrics(fingerprint(job), registry),
        checkpoint_dir=checkpoint_dir,
        on_route=on_route,
    )
    # Standbys (issue 67) where a member's state is the stage's, by number only: a standalone
    # trainer knows no peer's host, so it cannot tell a spare on another machine ("auto")
    if coordinator.rounds.readmits and job.runtime.standby != "auto":
        coordinator.membership.standbys.wanted = job.runtime.standby
    metrics = TrainerMetrics(fingerprint(job), registry)
    runs += [
        PipelineTrainer(job, coordinator, metrics=metrics, token=token, seed=i)
        for i in range(trainers)
    ]
    try:
        await coordinator.start()
        patience.committed()  # the patience counts from the start of training
        job_id = fingerprint(job)
        async with load_followed(broker, job_id, runs, token=token, registry=registry):
            # every trainer to its end and the job's; one failing ends the others (a gather
            # left them leasing from the coordinator the close below closes)
            together = alongside(coordinator.finished.wait(), [], [t.run() for t in runs])
            await bounded(together, patience)
        if coordinator.error:
            raise coordinator.error
        return await gather_state(coordinator)
    finally:
        for t in runs:
            await t.close()
        await coordinator.close()


async def run_trainer(
    job: JobConfig,
    replicas: list[list[Replica]],
    *,
    out: Path | None = None,
    log_path: Path | None = None,
    threads: int = 1,
    metrics_port: int | None = None,
    metrics_token: str | None = None,  # /metrics requires it (None: `token`)
    show_progress: bool = True,
    token: str | None = None,
    checkpoint_dir: Path | None = None,
    broker: str | None = None,
    routes: Path | None = None,
) -> int:
    if len(replicas) != job.training.stages:
        raise SystemExit(
            f"the job has {job.training.stages} stages; --stage-servers names {len(replicas)}"
        )
    # What it writes, opened before it trains (`swarm.ops.model_out`)
    for flag, path in (("--log", log_path), ("--routes", routes)):
        if path is not None:
            writable(flag, path, "a").close()
    torch.set_num_threads(max(1, threads))
    registry = CollectorRegistry()
    if metrics_port is not None:
        serve_metrics(registry, "127.0.0.1", metrics_port, token=metrics_token or token)
    with contextlib.ExitStack() as stack:
        model = None if out is None else stack.enter_context(ModelOut("--out", out))
        with StepLog(
            job.training.steps, path=log_path, desc=f"swarm {job.name}", show=show_progress
        ) as steps:
            state = await train_standalone(
                job,
                replicas,
                registry=registry,
                on_step=steps,
                token=token,
                checkpoint_dir=checkpoint_dir,
                broker=broker,
                routes=routes,
            )
        if model is not None:
            model.write(state)
            print(f"wrote {out}")
    return 0
