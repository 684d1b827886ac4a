"""Torch pipelining: samples/s of a job trained by `torch.distributed.pipelining`, the baseline
a swarm on one machine is held against (issue 69's peer-workload target, bench/peer_workload.py).

    python bench/torch_pipeline.py JOB.toml [--steps N] [--schedule gpipe|1f1b] [--threads T]
    python bench/torch_pipeline.py JOB.toml --rank R --address A --port P [--step-log PATH] ...

One process per stage (`training.stages`), gloo on localhost, each with `--threads` torch
threads (1: as each `swarm stage-server --threads 1`), each holding swarm's own stage of the
model (`swarm.model.transformer.build_stage`: the same layers, the same initial weights). A step
is the job's `target_batch_size` samples in `microbatch_size` microbatches (the job's own
synthetic data), pushed through the schedule, then AdamW on each stage (the job's lr). No
gradient clipping (it needs the norm across stages; a job with `grad_clip` is timed without it).
Rank 0 times each step, the pipeline drained and every rank past its optimizer step (a barrier),
and prints samples/s over the steps after the first (warm-up): its last line. The line before it
is each rank's process CPU seconds a step over the same steps (`cpu_s_per_step R0 R1 ...`: what
bench/cpu_split.py holds a swarm's processes against).

One rank. With `--rank`, the process is that one rank alone: its `init_method` is
`tcp://ADDRESS:PORT`, where rank 0 serves the rendezvous (`rank_argv` builds the command line).
bench/wan.py starts the ranks so, each in a network namespace of its own, over shaped links
(gloo then needs `GLOO_SOCKET_IFNAME` naming the host's device). With `--step-log`, rank 0
appends a JSON line a step once every rank is past it (`step`, `samples`, `seconds`: as a swarm
trainer's `--log` has them), which a caller can poll as the steps end.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_method(address: str, port: int) -> str:
    """The rendezvous every rank names: rank 0's address and port."""
    return f"tcp://{address}:{port}"


def rank_argv(
    job: Path,
    rank: int,
    address: str,
    port: int,
    steps: int,
    schedule: str = "gpipe",
    threads: int = 1,
    step_log: Path | None = None,
) -> list[str]:
    """The command line of one rank of a run whose rank 0 is at `address`:`port`."""
    argv = [sys.executable, str(Path(__file__).resolve()), str(job), "--steps", str(steps)]
    argv += ["--schedule", schedule, "--threads", str(threads), "--rank", str(rank)]
    argv += ["--address", address, "--port", str(port)]
    if step_log is not None:
        argv += ["--step-log", str(step_log)]
    return argv


def rank_main(
    job_path: Path,
    rank: int,
    rendezvous: str,
    steps: int,
    schedule: str,
    threads: int,
    step_log: Path | None = None,
) -> None:
    """One stage of the pipeline: rank `rank` of `training.stages`, meeting the others at
    `rendezvous` (an `init_method`); rank 0 appends each step to `step_log` if given."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from swarm.job.config import load_job
    from swarm.model.data import make_data
    from swarm.model.transformer import build_stage, loss_sum

    torch.set_num_threads(threads)
    job = load_job(job_path)
    world, t = job.training.stages, job.training
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    microbatches = t.target_batch_size // t.microbatch_size
    module = build_stage(job, rank)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    batch = microbatches * t.microbatch_size
    pipe = kind(stage, n_microbatches=microbatches, loss_fn=lambda y, x: loss_sum(y, x) / batch)
    optimizer = torch.optim.AdamW(module.parameters(), lr=job.optimizer.lr)
    data = make_data(job)
    seconds = []
    cpu = 0.0  # this process's CPU seconds (every thread) over the timed steps
    for step in range(steps):
        pairs = [data.microbatch(step, i) for i in range(microbatches)]
        ids, labels = torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])
        dist.barrier()
        started, cpu_started = time.perf_counter(), time.process_time()
        if rank == 0:
            pipe.step(ids)
        elif rank == world - 1:
            pipe.step(target=labels)
        else:
            pipe.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        seconds.append(time.perf_counter() - started)
        if rank == 0 and step_log is not None:
            line = {"step": step, "samples": batch, "seconds": seconds[-1]}
            with open(step_log, "a") as log:
                log.write(json.dumps(line) + "\n")
        if step or steps == 1:  # as the timed steps: the first is warm-up
            cpu += time.process_time() - cpu_started
    timed = seconds[1:] or seconds
    cpus: list[float] = [0.0] * world
    dist.all_gather_object(cpus, cpu / len(timed))
    dist.destroy_process_group()
    if rank == 0:
        print("cpu_s_per_step " + " ".join(f"{c:.4f}" for c in cpus), flush=True)
        print(batch * len(timed) / sum(timed), flush=True)


def samples_per_second(
    job: Path, steps: int, schedule: str = "gpipe", threads: int = 1, timeout: float = 600
) -> float:
    """One run, its ranks each a process of this script; rank 0's samples/s."""
    return run(job, steps, schedule, threads, timeout)[0]


def run(
    job: Path, steps: int, schedule: str = "gpipe", threads: int = 1, timeout: float = 600
) -> tuple[float, list[float]]:
    """One run: rank 0's samples/s, and each rank's process CPU seconds a step."""
    from bench.small_stages import first_on_path
    from swarm.job.config import load_job

    world, port = load_job(job).training.stages, free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": first_on_path(ROOT)}
    # gloo's own links on loopback: a host with no network resolves its name to nothing usable
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ranks = [
        subprocess.Popen(
            rank_argv(job, r, "127.0.0.1", port, steps, schedule, threads),
            stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        for r in range(world)
    ]
    try:
        out, err = ranks[0].communicate(timeout=timeout)
        for r in ranks[1:]:
            r.wait(timeout=60)
    finally:
        for r in ranks:
            if r.poll() is None:
                r.kill()
                r.wait()
    failed = [i for i, r in enumerate(ranks) if r.returncode]
    if failed:
        raise RuntimeError(f"torch pipelining: ranks {failed} failed:\n{err[-4000:]}")
    *_, cpu_line, rate = out.strip().splitlines()
    return float(rate), [float(c) for c in cpu_line.split()[1:]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("job", type=Path)
    parser.add_argument("--steps", type=int, default=6, help="steps (the first is warm-up)")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    parser.add_argument("--threads", type=int, default=1, help="torch threads a stage")
    parser.add_argument("--rank", type=int, help="run this one rank only (rank_argv)")
    parser.add_argument("--address", default="127.0.0.1", help="rank 0's address (with --rank)")
    parser.add_argument("--port", type=int, help="rank 0's rendezvous port (with --rank)")
    parser.add_argument("--step-log", type=Path, help="rank 0 appends a JSON line a step")
    args = parser.parse_args(argv)
    if args.rank is not None:
        if args.port is None:
            parser.error("--rank needs --port (rank 0's rendezvous)")
        rendezvous = init_method(args.address, args.port)
        rank_main(
            args.job, args.rank, rendezvous, args.steps, args.schedule, args.threads, args.step_log
        )
        return
    print(samples_per_second(args.job, args.steps, args.schedule, args.threads))


if __name__ == "__main__":
    main()
