"""Fault tolerance, measured: 4 stages x 2 replicas (separate processes) and a trainer.

    .venv/bin/python bench/faults.py [--steps N] [--kill-every S]

1. Stall: a replica of stage 1 is SIGKILLed mid-step; the stall is the time from the kill to the
   next hop completed on stage 1 (by its surviving replica).
2. Throughput under a steady kill rate: samples/s with no faults, then with a random replica
   SIGKILLed every `--kill-every` seconds and restarted two seconds later (it rejoins at a step
   boundary); both in this run, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prometheus_client import CollectorRegistry  # noqa: E402

from client.standalone import train_standalone  # noqa: E402
from swarm.job.config import load_job  # noqa: E402
from swarm.local.procs import SwarmProcess, start_process, stop_all  # noqa: E402
from swarm.ops.progress import StepRecord  # noqa: E402
from swarm.rpc.lease import Replica  # noqa: E402

JOB = """name = "faults-bench"
[model]
d_model = 64
n_layers = 4
n_heads = 4
seq_len = 64
[data]
kind = "synthetic"
[training]
stages = 4
microbatch_size = 8
target_batch_size = 64
steps = {steps}
[optimizer]
kind = "adamw"
lr = 1e-3
"""


# Each replica stands in for a device of its own: mostly waiting (as on a slower GPU), so eight of
# them do not fight over this machine's two cores and losing one costs capacity, as it should.
THROTTLE = 10.0


class Pool:
    def __init__(self, job: Path, work: Path) -> None:
        self.job, self.work, self.procs, self.ports = job, work, {}, {}
        for stage in range(4):
            for r in range(2):
                self.start(f"s{stage}r{r}", "0")
        for p in self.procs.values():
            p.wait_ready(120)
        self.ports = {n: p.address.rsplit(":", 1)[1] for n, p in self.procs.items()}

    def start(self, name: str, port: str) -> SwarmProcess:
        self.procs[name] = start_process(
            [
                "stage-server",
                "--job",
                str(self.job),
                "--stage",
                name[1],
                "--port",
                port,
                "--throttle",
                str(THROTTLE),
            ],
            log_dir=self.work,
            name=f"{name}-{time.monotonic_ns()}",
        )
        return self.procs[name]

    def replicas(self) -> list[list[Replica]]:
        return [
            [Replica(f"s{k}r{r}", f"127.0.0.1:{self.ports[f's{k}r{r}']}") for r in range(2)]
            for k in range(4)
        ]

    def stop(self) -> None:
        stop_all(list(self.procs.values()))


def _routed(registry: CollectorRegistry, stage: int) -> float:
    return sum(
        s.value
        for m in registry.collect()
        for s in m.samples
        if s.name == "swarm_trainer_routed_total" and s.labels.get("stage") == str(stage)
    )


def run(
    job_path: Path,
    pool: Pool,
    chaos: threading.Event | None = None,
    kill_every: float = 0.0,
    stall: list[float] | None = None,
) -> float:
    """Train the job once on `pool`; returns samples/s over the steps after the first."""
    registry, records = CollectorRegistry(), list[StepRecord]()
    stop = threading.Event()

    def killer() -> None:
        rng, last = random.Random(1), time.monotonic()
        while not stop.wait(0.01):
            if stall is not None and not stall and len(records) >= 2:
                before = _routed(registry, 1)
                pool.procs["s1r0"].kill()
                killed = time.monotonic()
                while not stop.is_set() and _routed(registry, 1) <= before:
                    time.sleep(0.001)
                stall.append(time.monotonic() - killed)
            if kill_every and time.monotonic() - last >= kill_every:
                name = f"s{rng.randrange(4)}r{rng.randrange(2)}"
                pool.procs[name].kill()
                time.sleep(2.0)
                pool.start(name, pool.ports[name]).wait_ready(120)
                last = time.monotonic()

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        asyncio.run(
            train_standalone(
                load_job(job_path), pool.replicas(), registry=registry, on_step=records.append
            )
        )
    finally:
        stop.set()
        thread.join()
    counted = records[1:]
    return sum(r.samples for r in counted) / sum(r.seconds for r in counted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="steps per run")
    parser.add_argument(
        "--kill-every", type=float, default=5.0, help="seconds between kills in the steady-rate run"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="swarm-faults-") as tmp:
        work = Path(tmp)
        results = {}
        for name, kill_every, stall in (
            ("no faults", 0.0, None),
            ("stall", 0.0, []),
            (f"kill every {args.kill_every:.0f}s", args.kill_every, None),
        ):
            job = work / f"{name.replace(' ', '-')}.toml"
            job.write_text(JOB.format(steps=args.steps))
            pool = Pool(job, work)
            try:
                results[name] = run(job, pool, kill_every=kill_every, stall=stall)
            finally:
                pool.stop()
            if stall is not None:
                print(
                    f"stall after killing a replica of stage 1: {stall[0] * 1000:.0f} ms "
                    f"(kill to the next completed hop on that stage)",
                    flush=True,
                )
        base = results["no faults"]
        for name, value in results.items():
            if name != "stall":
                print(
                    f"{name:<16} {value:>8.1f} samples/s   {value / base:.3f} of no faults",
                    flush=True,
                )


if __name__ == "__main__":
    main()
