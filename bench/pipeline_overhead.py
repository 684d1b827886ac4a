"""Pipeline overhead: samples/s of a swarm (4 stage servers on localhost, one trainer) against
`swarm local` (one process, all cores) on the same job, measured in the same run.

    .venv/bin/python bench/pipeline_overhead.py [--steps N] [--only tiny|d512]

The first step of each run is warm-up and not counted. Each process gets its share of the cores:
`swarm local` all of them, each stage server cores/4 (at least 1), the trainer 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swarm.local.procs import SwarmProcess, start_stage_servers, stop_all  # noqa: E402

JOBS = {
    # examples/tiny.toml's model on synthetic data
    "tiny": dict(
        d_model=64,
        n_layers=4,
        n_heads=4,
        seq_len=64,
        microbatch_size=8,
        target_batch_size=32,
        max_in_flight=8,
    ),
    "d512": dict(
        d_model=512,
        n_layers=4,
        n_heads=8,
        seq_len=128,
        microbatch_size=8,
        target_batch_size=128,
        max_in_flight=16,
    ),
}


def job_toml(name: str, steps: int, p: dict[str, int]) -> str:
    return f"""name = "{name}"
[model]
kind = "gpt"
vocab_size = 256
d_model = {p["d_model"]}
n_layers = {p["n_layers"]}
n_heads = {p["n_heads"]}
seq_len = {p["seq_len"]}
[data]
kind = "synthetic"
[training]
stages = 4
microbatch_size = {p["microbatch_size"]}
target_batch_size = {p["target_batch_size"]}
steps = {steps}
dtype = "float32"
[optimizer]
kind = "adamw"
lr = 1e-3
[runtime]
max_in_flight = {p["max_in_flight"]}
"""


def samples_per_second(log: Path) -> float:
    records = [json.loads(line) for line in log.read_text().splitlines()][1:]  # skip warm-up
    return sum(r["samples"] for r in records) / sum(r["seconds"] for r in records)


def swarm_cli(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "swarm.cli", *args],
        check=True,
        stderr=subprocess.DEVNULL,
        timeout=3600,
    )


def measure(name: str, steps: int, work: Path) -> tuple[float, float]:
    job = work / f"{name}.toml"
    job.write_text(job_toml(name, steps, JOBS[name]))
    cores = os.cpu_count() or 1
    local_log = work / f"{name}-local.jsonl"
    swarm_cli("local", str(job), "--threads", str(cores), "--log", str(local_log))
    local = samples_per_second(local_log)
    servers = start_stage_servers(job, 4, log_dir=work, threads=max(1, cores // 4), metrics=False)
    try:
        swarm = train_on(job, servers, work / f"{name}-swarm.jsonl")
    finally:
        stop_all(servers)
    return local, swarm


def train_on(job: Path, servers: list[SwarmProcess], log: Path) -> float:
    """Samples/s of a one-thread `swarm trainer` of `job` on `servers`, its steps logged to
    `log` (the first, warm-up, not counted)."""
    swarm_cli(
        "trainer",
        "--job",
        str(job),
        "--threads",
        "1",
        "--log",
        str(log),
        "--stage-servers",
        ",".join(s.address for s in servers),
    )
    return samples_per_second(log)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per run (first is warm-up)")
    parser.add_argument("--only", choices=sorted(JOBS), help="run one job only")
    args = parser.parse_args()
    print(f"{'job':<6} {'local samples/s':>16} {'swarm samples/s':>16} {'swarm/local':>12}")
    with tempfile.TemporaryDirectory(prefix="swarm-bench-") as tmp:
        for name in [args.only] if args.only else list(JOBS):
            local, swarm = measure(name, args.steps, Path(tmp))
            print(f"{name:<6} {local:>16.1f} {swarm:>16.1f} {swarm / local:>12.3f}", flush=True)


if __name__ == "__main__":
    main()
