"""The peer workload on localhost (issue 69's targets): samples/s of a swarm against the same job
in one process and against torch pipelining, in one sitting, alternated round by round.

    python bench/peer_workload.py [--rounds N] [--steps N] [--local-threads T] [--tiny]

The job is bench/small_stages.py's: byte GPT d256, 8 blocks, seq 128, microbatch 8, 8
microbatches a step, AdamW, default settings (the push plane; audits at the default fraction,
which with one replica a stage keep no record: issue 69 item 2). Each round runs, in turn:
  swarm        4 stage servers (one a stage, `--threads 1`) and a trainer (`--threads 1`);
  in-process   `swarm local`, the whole model in one process, `--local-threads` torch threads
               (default 4, the compute threads the swarm's stage servers have, or one per
               core where there are fewer: past the cores, torch's threads spin at each
               parallel region's end for a thread that is not running; on 2 cores, 4 threads
               ran 26.9-28.5 samples/s and 2 threads 34.0-35.9);
  torch        `torch.distributed.pipelining` (bench/torch_pipeline.py): 4 processes, gloo,
               one thread each, the faster of GPipe and 1F1B in the round.
The order turns each round so a drifting machine weighs on all alike; the first step of each
run is warm-up and not counted. A target's figure is the median over the rounds of the round's
ratio: swarm/in-process at least 0.92, swarm/torch at least 1.0 (a turn before b8f54b2's
figures). PASS or FAIL a target, a last `RESULT {json}` line, and exit status 1 on a miss.
`--tiny`: a d64 model, for a smoke run (its ratios judge nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

from bench import torch_pipeline  # noqa: E402
from bench.pipeline_overhead import samples_per_second  # noqa: E402
from bench.small_stages import JOB, first_on_path, tiny  # noqa: E402

TARGETS = {"swarm/in-process": 0.92, "swarm/torch": 1.0}  # at least


def job_text(steps: int, smoke: bool) -> str:
    text = JOB.format(steps=steps)
    return tiny(text) if smoke else text


def swarm_run(job: Path, steps: int, work: Path) -> float:
    """Samples/s of bench/small_stages.py's run (4 stage servers and a trainer) of `job`."""
    env = {**os.environ, "PYTHONPATH": first_on_path(ROOT)}
    args = [sys.executable, str(HERE.parent / "small_stages.py"), "--child", str(work)]
    args += ["--steps", str(steps), "--job", str(job)]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode:  # its own error, said where the bench's log shows it
        raise RuntimeError(f"swarm failed (exit status {out.returncode}):\n{out.stderr[-3000:]}")
    return float(out.stdout.split()[-1])


def local_run(job: Path, threads: int, work: Path) -> float:
    log = work / "local.jsonl"
    cmd = [sys.executable, "-m", "swarm.cli", "local", str(job), "--threads", str(threads)]
    subprocess.run(
        [*cmd, "--log", str(log)],
        env={**os.environ, "PYTHONPATH": first_on_path(ROOT)},
        check=True,
        stderr=subprocess.DEVNULL,
        timeout=900,
    )
    return samples_per_second(log)


def torch_run(job: Path, steps: int) -> float:
    return max(torch_pipeline.samples_per_second(job, steps, s) for s in ("gpipe", "1f1b"))


def verdicts(rounds: list[dict[str, float]]) -> dict[str, tuple[float, bool]]:
    """Each target's median ratio over `rounds` (samples/s by run) and whether it is met."""
    ratios = {
        "swarm/in-process": [r["swarm"] / r["in-process"] for r in rounds],
        "swarm/torch": [r["swarm"] / r["torch"] for r in rounds],
    }
    out = {}
    for name, values in ratios.items():
        median = statistics.median(values)
        out[name] = (median, median >= TARGETS[name])
    return out


def local_threads(cores: int | None = None) -> int:
    """The in-process run's default torch threads: the swarm's compute threads (4), or one per
    core of this machine where it has fewer (`cores`: os.cpu_count())."""
    return max(1, min(4, cores if cores is not None else os.cpu_count() or 1))


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1, help="rounds of the three runs")
    parser.add_argument("--steps", type=int, default=5, help="steps a run (first: warm-up)")
    parser.add_argument(
        "--local-threads", type=int, default=local_threads(), help="`swarm local` threads"
    )
    parser.add_argument("--tiny", action="store_true", help="a d64 model: a smoke run")
    args = parser.parse_args()
    runs: dict[str, Callable[[Path, Path], float]] = {
        "swarm": lambda job, work: swarm_run(job, args.steps, work),
        "in-process": lambda job, work: local_run(job, args.local_threads, work),
        "torch": lambda job, work: torch_run(job, args.steps),
    }
    names = list(runs)
    rounds: list[dict[str, float]] = []
    print(f"{'round':<6}" + "".join(f"{n + ' samples/s':>22}" for n in names), flush=True)
    for i in range(args.rounds):
        got: dict[str, float] = {}
        for name in names[i % 3 :] + names[: i % 3]:
            with tempfile.TemporaryDirectory(prefix="swarm-peer-") as tmp:
                job = Path(tmp) / "job.toml"
                job.write_text(job_text(args.steps, args.tiny))
                got[name] = runs[name](job, Path(tmp))
        rounds.append(got)
        print(f"{i:<6}" + "".join(f"{got[n]:>22.2f}" for n in names), flush=True)
    judged = verdicts(rounds)
    for name, (median, met) in judged.items():
        verdict = "PASS" if met else "FAIL"
        print(f"{verdict}: {name} median {median:.3f} (target >= {TARGETS[name]})", flush=True)
    result = {name: round(median, 4) for name, (median, _) in judged.items()}
    print("RESULT " + json.dumps({"rounds": rounds, "ratios": result, "tiny": args.tiny}))
    return 0 if all(met for _, met in judged.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
