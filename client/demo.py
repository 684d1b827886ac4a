"""`swarm demo`: a local swarm (one stage server per stage, as separate processes) trains the
example job, shows its progress and metrics endpoints, and shuts everything down."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

from client.run import run_trainer
from swarm.config import load_job
from swarm.procs import start_stage_servers, stop_all

__all__ = ["run_demo"]


def run_demo(job_path: Path, stages_from_job: bool = True) -> int:
    job = load_job(job_path)
    stages = job.training.stages
    log_dir = Path(tempfile.mkdtemp(prefix="swarm-demo-"))
    print(f"starting {stages} stage servers (logs in {log_dir}) ...", flush=True)
    threads = max(1, (os.cpu_count() or 1) // stages)
    servers = start_stage_servers(job_path, stages, log_dir=log_dir, threads=threads)
    try:
        for k, s in enumerate(servers):
            print(
                f"  stage {k}: {s.address}  layers {s.ready['layers']}  "
                f"metrics http://127.0.0.1:{s.ready['metrics']}/metrics",
                flush=True,
            )
        addresses = [s.address for s in servers]
        rc = asyncio.run(run_trainer(job, addresses, log_path=log_dir / "steps.jsonl"))
        print(f"done: per-step losses in {log_dir / 'steps.jsonl'}")
        return rc
    finally:
        stop_all(servers)
