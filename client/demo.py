"""`swarm demo` (what `make demo` runs): an embedded MQTT broker and a scheduler, stage servers of
different speeds as separate processes, the example job submitted and trained with its progress
shown, a replica killed halfway to show training carry on, the metrics endpoints listed, and
everything shut down with no process left behind. `--chaos` keeps killing replicas and starting
fresh peers that join the running job."""

from __future__ import annotations

import asyncio
import math
import os
import random
import tempfile
from pathlib import Path

from tqdm import tqdm

from client.commands import watch
from client.sdk import SchedulerClient, state_name
from swarm.config import load_job
from swarm.procs import LocalSwarm, start_local_swarm
from swarm.proto import scheduler_pb2

__all__ = ["DEFAULT_THROTTLES", "run_demo"]

# Five peers of different speeds, as on a volunteer swarm: 1x to 3x slower than this machine's
# cores. One more peer than stages, so at least one stage has a pool of two replicas.
DEFAULT_THROTTLES = (1.0, 1.5, 2.0, 3.0, 1.0)


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


def _victim(status: scheduler_pb2.JobStatus, rng: random.Random) -> str | None:
    """A replica whose stage keeps another one: killing it shows training carry on."""
    pools = [s for s in status.stages if len(s.replicas) >= 2]
    return rng.choice(rng.choice(pools).replicas).peer if pools else None


async def _kill(sw: LocalSwarm, client: SchedulerClient, job: str, chaos: bool) -> None:
    """Halfway through, SIGKILL one replica; with `chaos`, keep doing it every few steps and
    start a fresh peer in its place each time (it joins the running job)."""
    rng, killed_at = random.Random(0), -1
    while True:
        await asyncio.sleep(0.2)
        status = await client.get(job)
        if state_name(status.state) not in ("placing", "running"):
            return
        if killed_at < 0:
            due = status.step >= status.steps // 2
        else:
            due = chaos and status.step >= killed_at + 5
        victim = _victim(status, rng) if due and status.step < status.steps - 3 else None
        if victim is None:
            continue
        next(p for p in sw.peers if p.ready.get("peer") == victim).kill()
        killed_at = status.step
        tqdm.write(
            f"** step {status.step}: killed {victim} with SIGKILL; its stage keeps a "
            f"replica, its gradients are replayed there, and training carries on **"
        )
        if chaos:
            peer = await asyncio.to_thread(sw.add_peer, rng.choice([1.0, 1.5, 2.0]))
            tqdm.write(
                f"** a fresh peer {peer.ready['peer']} joins; it copies its stage's "
                f"state at a step boundary **"
            )


async def _train(sw: LocalSwarm, job_path: Path, chaos: bool) -> int:
    async with SchedulerClient(sw.address) as client:
        status = await client.submit(job_path)
        print(
            f"submitted {job_path.name} as job {status.job}; `swarm status {status.job} "
            f"--scheduler {sw.address}` shows it from another terminal",
            flush=True,
        )
        killer = asyncio.create_task(_kill(sw, client, status.job, chaos))
        try:
            final = await watch(client, status)
        finally:
            killer.cancel()
        steps = await asyncio.to_thread(_losses, sw, status.job)
    if state_name(final.state) == "succeeded":
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


def run_demo(
    job_path: Path, throttles: tuple[float, ...] = DEFAULT_THROTTLES, chaos: bool = False
) -> int:
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
        return asyncio.run(_train(sw, job_path, chaos))
    finally:
        print("shutting down ...", flush=True)
        sw.stop()
        left = [p for p in [sw.scheduler, *sw.peers] if p.proc.poll() is None]
        print("all processes stopped" if not left else f"still running: {left}")
