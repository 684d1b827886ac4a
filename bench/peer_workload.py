"""The peer workload on localhost (issue 69's targets): samples/s of a swarm against the same job
in one process and against torch pipelining, in one sitting, alternated round by round.

    python bench/peer_workload.py [--rounds N] [--steps N] [--local-threads T] [--bubble] [--tiny]

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
  in-process, 1 thread   (`--bubble` only) `swarm local` on one torch thread: what the
               in-process run's threads speed it up by (s), so that the pipeline's bubble can
               be told from the rest of swarm/in-process's gap. At M microbatches a step and
               S stages a stage idles S-1 of every M+S-1 slots (fill and drain, GPipe's and
               1F1B's alike with equal stages), so with a core a stage server
               swarm/in-process is at most M/(M+S-1) x S/s: printed as "the bubble's bound",
               a figure beside the targets, not a verdict.
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
from swarm.job.config import parse_job  # noqa: E402

TARGETS = {"swarm/in-process": 0.92, "swarm/torch": 1.0}  # at least
ONE_THREAD = "in-process, 1 thread"  # `--bubble`'s run


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


def bubble_bound(stages: int, microbatches: int, one_thread: float, in_process: float) -> float:
    """The most swarm/in-process can be for a pipeline of `stages` stage servers of one thread
    each, `microbatches` a step, where `swarm local` runs `one_thread` samples/s on one thread
    and `in_process` on its threads: a stage busy M of every M+S-1 slots, S of them at once."""
    busy = microbatches / (microbatches + stages - 1)
    return busy * stages * one_thread / in_process


def bubble(rounds: list[dict[str, float]], stages: int, microbatches: int) -> tuple[float, str]:
    """The bubble's bound over `rounds` (each with its 1-thread run), their median, and a line
    that sets swarm/in-process's median beside it."""
    bound = statistics.median(
        bubble_bound(stages, microbatches, r[ONE_THREAD], r["in-process"]) for r in rounds
    )
    speedup = statistics.median(r["in-process"] / r[ONE_THREAD] for r in rounds)
    measured = verdicts(rounds)["swarm/in-process"][0]
    return bound, (
        f"the bubble's bound: swarm/in-process at most {bound:.3f} ({microbatches} microbatches, "
        f"{stages} stages; in-process {speedup:.2f}x its 1-thread run); measured "
        f"{measured:.3f}, {measured / bound:.2f} of it"
    )


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
    parser.add_argument(
        "--bubble", action="store_true", help="also `swarm local` on 1 thread: the bubble's bound"
    )
    parser.add_argument("--tiny", action="store_true", help="a d64 model: a smoke run")
    args = parser.parse_args()
    runs: dict[str, Callable[[Path, Path], float]] = {
        "swarm": lambda job, work: swarm_run(job, args.steps, work),
        "in-process": lambda job, work: local_run(job, args.local_threads, work),
        "torch": lambda job, work: torch_run(job, args.steps),
    }
    if args.bubble:
        runs[ONE_THREAD] = lambda job, work: local_run(job, 1, work)
    names = list(runs)
    rounds: list[dict[str, float]] = []
    width = {n: max(22, len(n) + 12) for n in names}  # each column its name's room
    print(f"{'round':<6}" + "".join(f"{n + ' samples/s':>{width[n]}}" for n in names), flush=True)
    for i in range(args.rounds):
        got: dict[str, float] = {}
        for name in names[i % len(names) :] + names[: i % len(names)]:
            with tempfile.TemporaryDirectory(prefix="swarm-peer-") as tmp:
                job = Path(tmp) / "job.toml"
                job.write_text(job_text(args.steps, args.tiny))
                got[name] = runs[name](job, Path(tmp))
        rounds.append(got)
        print(f"{i:<6}" + "".join(f"{got[n]:>{width[n]}.2f}" for n in names), flush=True)
    judged = verdicts(rounds)
    for name, (median, met) in judged.items():
        verdict = "PASS" if met else "FAIL"
        print(f"{verdict}: {name} median {median:.3f} (target >= {TARGETS[name]})", flush=True)
    result = {name: round(median, 4) for name, (median, _) in judged.items()}
    if args.bubble:
        training = parse_job(job_text(args.steps, args.tiny), ROOT, check_data=False).training
        bound, line = bubble(rounds, training.stages, training.microbatches_per_step)
        print(f"{line} ({args.local_threads} threads in-process)", flush=True)
        result["bubble bound"] = round(bound, 4)
    print("RESULT " + json.dumps({"rounds": rounds, "ratios": result, "tiny": args.tiny}))
    return 0 if all(met for _, met in judged.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
