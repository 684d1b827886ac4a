"""Stochastic wiring against the pool's capacity: one stage served by four replicas whose compute
is throttled 1 : 1 : 2 : 4 (so their speeds are 1 : 1 : 1/2 : 1/4), each a separate process.

    .venv/bin/python bench/wiring.py [--steps N] [--base-throttle F] [--data-plane push]
        [--delayed-update]

The capacity is the sum of each replica's samples/s measured alone, in this run (with
`training.delayed_update`, so no step barrier is counted against a replica alone; an earlier
version ran them synchronous and counted each small step's drain and commit against them).
Caution: on a 2-core machine the pool can still beat that sum (2026-11-24: 1.14 of it, its
rates half of another day's), since a throttled replica's hold scales with its compute time,
which sharing the cores changes: compare rows of one run, not a row with 1. Then the same
pool is driven with our wiring, with uniform-random routing and with round-robin routing, and
each one's samples/s is printed with its ratio to the capacity. The throttles are multiplied by
`--base-throttle` so that the replicas mostly wait (as a slower device does) rather than compete
for this machine's two cores, which would make the capacity a fiction.

With `--data-plane push` the pool is stage 1 of a two-stage job whose stage 0 is one unthrottled
replica: every hop into the pool is chosen by that replica (`stage_server.replica.next_hop`), not by
the trainer, so this measures the stage servers' own wiring (the baselines replace the trainer's
choice only, so they are not run).

With `--delayed-update` the wiring also runs a job with `training.delayed_update` (a fresh pool,
the same steps), whose commits overlap the next step's microbatches: the step barrier's cost is
what separates the two rows.

Samples/s: the samples of every step after the first (warm-up), over the time from the first
lease of the second step to the end of the last. Synchronous, that lease follows the first
step's end; with `delayed_update` it comes earlier, while the first step drains, whose work the
window then holds without counting it (a bias against delayed updates, never for them).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from client.trainer import PipelineTrainer  # noqa: E402
from scheduler.coordinator import LocalCoordinator  # noqa: E402
from swarm.job.config import load_job  # noqa: E402
from swarm.job.fingerprint import fingerprint  # noqa: E402
from swarm.local.procs import SwarmProcess, start_process, stop_all  # noqa: E402
from swarm.ops.progress import StepRecord  # noqa: E402
from swarm.rpc.lease import Lease, Replica  # noqa: E402

RELATIVE_THROTTLES = (1.0, 1.0, 2.0, 4.0)
JOB = """name = "wiring-bench"
[model]
d_model = 64
n_layers = 2
n_heads = 4
seq_len = 64
[data]
kind = "synthetic"
[training]
stages = {stages}
microbatch_size = 8
target_batch_size = {batch}
steps = {steps}
delayed_update = {delayed}
[optimizer]
kind = "adamw"
lr = 1e-3
[runtime]
max_in_flight = 16
data_plane = "{plane}"
"""


def route_randomly(trainer: PipelineTrainer, how: str) -> None:
    """Replace the wiring's choice for the stage with a baseline router."""
    pool, rng = trainer.wiring[0], random.Random(0)
    if how == "random":
        pool.choose = lambda task_samples: rng.choice(sorted(pool.eligible()))  # type: ignore[method-assign]
    elif how == "round-robin":
        order = itertools.cycle(sorted(pool.eligible()))
        pool.choose = lambda task_samples: next(order)  # type: ignore[method-assign]


async def throughput(
    job_path: Path, replicas: list[SwarmProcess], router: str, front: SwarmProcess | None
) -> float:
    """Samples/s over the job's steps after the first (warm-up); `front` is the stage-0 replica
    in front of the pool (push)."""
    job = load_job(job_path)
    records: list[tuple[float, StepRecord]] = []  # (when, record)
    members = [[Replica(r.address, r.address, 1.0) for r in replicas]]
    if front is not None:
        members.insert(0, [Replica(front.address, front.address, 1.0)])

    def on_step(record: StepRecord) -> None:
        records.append((time.perf_counter(), record))

    coordinator = LocalCoordinator(job, fingerprint(job), lambda: members, on_step=on_step)
    lease = coordinator.lease
    started: list[float] = []  # when the second step's first task was leased

    async def leased(trainer: str, count: int, **kwargs: Any) -> Lease:
        got = await lease(trainer, count, **kwargs)
        if not started and any(task.step >= 1 for task in got.tasks):
            started.append(time.perf_counter())
        return got

    coordinator.lease = leased  # type: ignore[method-assign]
    trainer = PipelineTrainer(job, coordinator, seed=0)
    try:
        await coordinator.start()
        trainer.sync(coordinator.replicas())
        route_randomly(trainer, router)
        await asyncio.gather(trainer.run(), coordinator.finished.wait())
    finally:
        await trainer.close()
        await coordinator.close()
    samples = sum(r.samples for _, r in records[1:])
    return samples / (records[-1][0] - started[0])


def start_server(job: Path, stage: int, throttle: float, work: Path, name: str) -> SwarmProcess:
    return start_process(
        [
            "stage-server",
            "--job",
            str(job),
            "--stage",
            str(stage),
            "--port",
            "0",
            "--throttle",
            str(throttle),
        ],
        log_dir=work,
        name=name,
    )


def start_pool(
    jobs: list[Path], base: float, work: Path, name: str, stage: int
) -> list[SwarmProcess]:
    """One replica of `stage` per relative throttle, replica i serving `jobs[i]`; returns once
    all serve."""
    servers = [
        start_server(job, stage, base * relative, work, f"{name}{i}")
        for i, (job, relative) in enumerate(zip(jobs, RELATIVE_THROTTLES, strict=True))
    ]
    for s in servers:
        s.wait_ready(120)
    return servers


def start_front(job: Path, work: Path, name: str) -> SwarmProcess:
    front = start_server(job, 0, 1.0, work, name)
    front.wait_ready(120)
    return front


async def run(
    steps: int, base: float, work: Path, microbatches: int, plane: str, delayed: bool
) -> None:
    push = plane == "push"
    stages, pool_stage = (2, 1) if push else (1, 0)
    servers: list[SwarmProcess] = []
    fronts: list[SwarmProcess] = []
    try:
        # Alone, a replica's rate is its service rate whatever the step size (no barrier: its
        # commits overlap): small steps, and one job file each so that every run starts at 0.
        alone_jobs = [work / f"job{i}.toml" for i in range(len(RELATIVE_THROTTLES))]
        for job in alone_jobs:
            job.write_text(
                JOB.format(batch=8 * 32, steps=3, stages=stages, plane=plane, delayed="true")
            )
        servers = start_pool(alone_jobs, base, work, "replica", pool_stage)
        if push:
            fronts = [start_front(job, work, f"front{i}") for i, job in enumerate(alone_jobs)]
        alone = [
            await throughput(job, [server], "wiring", fronts[i] if push else None)
            for i, (job, server) in enumerate(zip(alone_jobs, servers, strict=True))
        ]
        capacity = sum(alone)
        if push:
            print("data plane push: the pool is stage 1, fed by one stage-0 replica")
        print(
            "replica throttles      " + "  ".join(f"{base * r:>6.1f}" for r in RELATIVE_THROTTLES)
        )
        print("alone (samples/s)      " + "  ".join(f"{a:>6.1f}" for a in alone))
        print(f"capacity (sum)         {capacity:.1f} samples/s")
        print(f"{'routing':<14} {'samples/s':>10} {'of capacity':>12}")
        routers = ["wiring"] if push else ["wiring", "random", "round-robin"]
        if delayed:
            routers.insert(1, "wiring+delayed")
        for name in routers:
            # A fresh pool per router (at step 0) keeps the runs equal.
            router = name.split("+")[0]
            stop_all(servers + fronts)
            job_path = work / f"pool-{name}.toml"
            flag = "true" if name.endswith("+delayed") else "false"
            job_path.write_text(
                JOB.format(
                    batch=8 * microbatches, steps=steps, stages=stages, plane=plane, delayed=flag
                )
            )
            jobs = [job_path] * len(RELATIVE_THROTTLES)
            servers = start_pool(jobs, base, work, router, pool_stage)
            fronts = [start_front(job_path, work, f"front-{router}")] if push else []
            value = await throughput(job_path, servers, router, fronts[0] if push else None)
            print(f"{name:<14} {value:>10.1f} {value / capacity:>12.3f}", flush=True)
    finally:
        stop_all(servers + fronts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per run (first is warm-up)")
    parser.add_argument(
        "--microbatches",
        type=int,
        default=512,
        help="microbatches (of 8 samples) per step of the pool runs: large steps "
        "amortise each step's commit and the drain before it",
    )
    parser.add_argument(
        "--base-throttle", type=float, default=8.0, help="multiplies the 1:1:2:4 throttles"
    )
    parser.add_argument("--data-plane", choices=("relay", "push"), default="relay")
    parser.add_argument(
        "--delayed-update",
        action="store_true",
        help="also run the wiring with training.delayed_update (commits overlap the next step)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="swarm-wiring-") as tmp:
        run_ = run(
            args.steps,
            args.base_throttle,
            Path(tmp),
            args.microbatches,
            args.data_plane,
            args.delayed_update,
        )
        asyncio.run(run_)


if __name__ == "__main__":
    main()
