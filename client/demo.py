"""`swarm demo` (what `make demo` runs): an embedded MQTT broker and a scheduler, stage servers of
different speeds as separate processes, the example job submitted and trained with its progress
shown, the metrics endpoints listed, and everything shut down with no process left behind."""

from __future__ import annotations

import asyncio
import math
import os
import tempfile
from pathlib import Path

from client.commands import watch
from client.sdk import SchedulerClient, state_name
from swarm.config import load_job
from swarm.procs import LocalSwarm, start_local_swarm

__all__ = ["DEFAULT_THROTTLES", "run_demo"]

# Four peers of different speeds, as on a volunteer swarm: 1x, 1.5x, 2x and 3x slower than this
# machine's cores.
DEFAULT_THROTTLES = (1.0, 1.5, 2.0, 3.0)


def _show_endpoints(sw: LocalSwarm) -> None:
    s = sw.scheduler.ready
    print(
        f"  scheduler   {s['address']}  broker {s['broker']}  "
        f"metrics http://127.0.0.1:{s['metrics']}/metrics"
    )
    for p in sw.peers:
        r = p.ready
        print(
            f"  {r['peer']:<10}  {r['address']}  throttle {float(r['throttle']):.1f}x  "
            f"metrics http://127.0.0.1:{r['metrics']}/metrics"
        )


async def _train(sw: LocalSwarm, job_path: Path) -> int:
    async with SchedulerClient(sw.address) as client:
        status = await client.submit(job_path)
        print(
            f"submitted {job_path.name} as job {status.job}; `swarm status {status.job} "
            f"--scheduler {sw.address}` shows it from another terminal",
            flush=True,
        )
        final = await watch(client, status)
        steps = await asyncio.to_thread(_losses, sw, status.job)
    if final.state != status.state and state_name(final.state) == "succeeded":
        first = steps[0] if steps else math.nan
        print(
            f"job {final.job} succeeded: {final.step} steps, loss {first:.3f} -> {final.loss:.3f}"
        )
        return 0
    print(f"job {final.job} {state_name(final.state)}: {final.error or final.message}")
    return 1


def _losses(sw: LocalSwarm, job_id: str) -> list[float]:
    from scheduler.store import JobStore

    with JobStore(sw.log_dir / "jobs.sqlite") as store:
        return [row.loss for row in store.steps(job_id)]


def run_demo(job_path: Path, throttles: tuple[float, ...] = DEFAULT_THROTTLES) -> int:
    job = load_job(job_path)  # a bad job file fails here, before anything starts
    log_dir = Path(tempfile.mkdtemp(prefix="swarm-demo-"))
    threads = max(1, (os.cpu_count() or 1) // len(throttles))
    print(
        f"starting a scheduler (with an embedded MQTT broker) and {len(throttles)} stage "
        f"servers for a {job.training.stages}-stage model; logs in {log_dir}",
        flush=True,
    )
    sw, _ = start_local_swarm(list(throttles), log_dir=log_dir, threads=threads)
    try:
        _show_endpoints(sw)
        return asyncio.run(_train(sw, job_path))
    finally:
        print("shutting down ...", flush=True)
        sw.stop()
        left = [p for p in [sw.scheduler, *sw.peers] if p.proc.poll() is None]
        print("all processes stopped" if not left else f"still running: {left}")
