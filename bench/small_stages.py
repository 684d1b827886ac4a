"""Small stages: samples/s of the small-stage workload (byte GPT d256, 8 blocks, seq 128, 4 stages,
microbatch 8, 8 microbatches a step, AdamW; one stage server per stage and a trainer, one thread
each) on two checkouts, run alternately in one sitting, with the ratio of each pair.

    .venv/bin/python bench/small_stages.py BASE [NEW] [--pairs N] [--steps N]

BASE and NEW are checkouts (paths; NEW defaults to this one). Each run's processes import the
checkout's own code (PYTHONPATH), so an old commit is measured as it was. The runs alternate
(BASE, NEW, NEW, BASE, BASE, NEW, ...) so a machine that drifts slower or faster weighs on both
alike. The first step of each run is warm-up and not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()

JOB = """name = "small-stages"
[model]
kind = "gpt"
vocab_size = 256
d_model = 256
n_layers = 8
n_heads = 8
seq_len = 128
[data]
kind = "synthetic"
[training]
stages = 4
microbatch_size = 8
target_batch_size = 64
steps = {steps}
dtype = "float32"
[optimizer]
kind = "adamw"
lr = 1e-3
[runtime]
max_in_flight = 16
"""


def first_on_path(checkout: Path) -> str:
    """PYTHONPATH with `checkout` first (its code is the one measured), and whatever was on it
    after: a host's carried wheels' site (bench/carried_wheels.sh) must stay importable."""
    return os.pathsep.join(p for p in (str(checkout), os.environ.get("PYTHONPATH", "")) if p)


def tiny(job: str) -> str:
    """`job` (JOB, or one made from it) with a d64 model: a smoke run of a bench built on JOB,
    whose figures judge nothing."""
    return job.replace("d_model = 256", "d_model = 64").replace("n_heads = 8", "n_heads = 4")


def child(steps: int, work: Path, metrics: bool, given: Path | None = None) -> None:
    """One run against the checkout on sys.path (the parent set PYTHONPATH), of `JOB` or the
    job file `given` (bench/peer_workload.py's smoke run: a smaller model); prints samples/s."""
    try:
        from swarm.local.procs import start_stage_servers, stop_all
    except ImportError:  # checkouts before swarm/local/ existed
        from swarm.procs import start_stage_servers, stop_all  # type: ignore[no-redef]
    job = given or work / "job.toml"
    if given is None:
        job.write_text(JOB.format(steps=steps))
    log = work / "trainer.jsonl"
    servers = start_stage_servers(job, 4, log_dir=work, threads=1, metrics=metrics)
    try:
        addresses = ",".join(s.address for s in servers)
        trainer = ["trainer", "--job", str(job), "--threads", "1", "--log", str(log)]
        subprocess.run(
            [sys.executable, "-m", "swarm.cli", *trainer, "--stage-servers", addresses],
            check=True,
            stderr=subprocess.DEVNULL,
            timeout=3600,
        )
    finally:
        stop_all(servers)
    records = [json.loads(line) for line in log.read_text().splitlines()][1:]  # skip warm-up
    print(sum(r["samples"] for r in records) / sum(r["seconds"] for r in records))


def run(checkout: Path, steps: int, metrics: bool) -> float:
    with tempfile.TemporaryDirectory(prefix="swarm-small-") as tmp:
        args = [sys.executable, str(HERE), "--child", tmp, "--steps", str(steps)]
        out = subprocess.run(
            args + (["--metrics"] if metrics else []),
            cwd=checkout,
            env={**os.environ, "PYTHONPATH": first_on_path(checkout)},
            check=True,
            capture_output=True,
            text=True,
            timeout=3600,
        )
    return float(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path, nargs="?", help="the checkout to compare against")
    parser.add_argument("new", type=Path, nargs="?", default=HERE.parent.parent)
    parser.add_argument("--pairs", type=int, default=3, help="alternated pairs of runs")
    parser.add_argument("--steps", type=int, default=8, help="steps per run (first is warm-up)")
    parser.add_argument("--metrics", action="store_true", help="stage servers serve /metrics")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--job", type=Path, help=argparse.SUPPRESS)  # a child's, not JOB
    args = parser.parse_args()
    if args.child:
        child(args.steps, args.child, args.metrics, args.job)
        return
    if args.base is None:
        parser.error("BASE is required")
    base, new = args.base.resolve(), args.new.resolve()
    print(f"base {base}\nnew  {new}")
    print(f"{'pair':<5} {'base samples/s':>15} {'new samples/s':>14} {'new/base':>9}", flush=True)
    ratios = []
    for i in range(args.pairs):
        order = [base, new] if i % 2 == 0 else [new, base]
        got = {c: run(c, args.steps, args.metrics) for c in order}
        ratios.append(got[new] / got[base])
        print(f"{i:<5} {got[base]:>15.2f} {got[new]:>14.2f} {ratios[-1]:>9.3f}", flush=True)
    print(f"median new/base {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
