"""Where the peer workload's CPU goes, a step: each swarm process's threads (its compute thread,
its event loop, the rest: gRPC's) against torch pipelining's ranks, in CPU seconds a step.

    python bench/cpu_split.py [--steps N] [--tiny]
    python bench/cpu_split.py --against BASE [--pairs N] [--steps N]

With `--against`, no torch run: the swarm half alone, of checkout BASE and of this one,
alternated (BASE, this, this, BASE, ...; each run imports its checkout's code), and for each
the stage servers' event loops, everything but their compute threads, and the total, with
each pair's ratio (this over BASE) and the medians: what a change to the per-hop machinery
moves, which the total's noise hides on a loaded machine.

Issue 69's swarm/torch target is met on a 2-core host only if the swarm's five processes spend
no more CPU a step than torch's four ranks: both keep the two cores busy, so a step takes their
CPU over two. CPU seconds (utime + stime of /proc/PID/task/TID/stat) hold on a loaded machine,
where samples/s and py-spy's idle/active split do not (a runnable thread waiting for a core is
sampled as active). The swarm run is bench/small_stages.py's (4 stage servers and a trainer,
one thread each, default settings); its threads are read when the trainer's log has its second
step and again at its last but one (so neither start-up nor the warm-up step counts). A stage
server's busiest thread is its compute thread (`Worker`); its main thread is the event loop.
Torch's figure is each rank's process CPU over its timed steps (bench/torch_pipeline.py, GPipe).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import torch_pipeline  # noqa: E402
from bench.proc_cpu import TICK as TICK  # noqa: E402
from bench.proc_cpu import stat_seconds  # noqa: E402
from bench.small_stages import JOB, first_on_path, tiny  # noqa: E402


def threads(pid: int) -> dict[int, float]:
    """Each live thread of `pid`: its CPU seconds so far."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = stat_seconds(Path(f"/proc/{pid}/task/{tid}/stat").read_text())
        except (FileNotFoundError, ProcessLookupError):  # ended between the listing and the read
            continue
    return out


@dataclass(frozen=True)
class Split:
    """One process's CPU seconds a step: its busiest thread, its main thread, the rest."""

    compute: float
    loop: float
    other: float

    @property
    def total(self) -> float:
        return self.compute + self.loop + self.other


def split(before: dict[int, float], after: dict[int, float], pid: int, steps: int) -> Split:
    """The CPU each thread of process `pid` spent between the two readings, a step: the main
    thread (tid == pid) is the loop, the busiest other thread the compute; a thread that started
    between them counts from zero, one that ended is not seen."""
    spent = {tid: s - before.get(tid, 0.0) for tid, s in after.items()}
    loop = spent.pop(pid, 0.0)
    compute = max(spent.values(), default=0.0)
    other = sum(spent.values()) - compute
    return Split(compute / steps, loop / steps, other / steps)


def swarm_split(job: Path, steps: int, work: Path) -> dict[str, Split]:
    """Each swarm process's split over its steps 2 .. steps-1 (the trainer's log records)."""
    from swarm.local.procs import start_stage_servers, stop_all

    log = work / "trainer.jsonl"
    servers = start_stage_servers(job, 4, log_dir=work, threads=1, metrics=False)
    try:
        addresses = ",".join(s.address for s in servers)
        args = ["trainer", "--job", str(job), "--threads", "1", "--log", str(log)]
        trainer = subprocess.Popen(
            [sys.executable, "-m", "swarm.cli", *args, "--stage-servers", addresses],
            env={**os.environ, "PYTHONPATH": first_on_path(ROOT)},
            stderr=subprocess.DEVNULL,
        )
        pids = {f"stage {k}": s.proc.pid for k, s in enumerate(servers)}
        pids["trainer"] = trainer.pid
        first, last = 2, steps - 1
        readings = []
        for records in (first, last):
            while (len(log.read_text().splitlines()) if log.exists() else 0) < records:
                if trainer.poll() is not None:
                    raise RuntimeError(f"the trainer ended (status {trainer.returncode})")
                time.sleep(0.01)
            readings.append({name: threads(pid) for name, pid in pids.items()})
        trainer.wait(timeout=600)
    finally:
        stop_all(servers)
    before, after = readings
    return {n: split(before[n], after[n], pid, last - first) for n, pid in pids.items()}


_CHILD = """
import json, sys, tempfile
from pathlib import Path
from bench.cpu_split import JOB, swarm_split, tiny
steps, small = int(sys.argv[1]), sys.argv[2] == "tiny"
with tempfile.TemporaryDirectory(prefix="swarm-cpu-") as tmp:
    job = Path(tmp) / "job.toml"
    job.write_text(tiny(JOB.format(steps=steps)) if small else JOB.format(steps=steps))
    split = swarm_split(job, steps, Path(tmp))
print(json.dumps({name: [s.compute, s.loop, s.other] for name, s in split.items()}))
"""

FIGURES = ("loops", "rest", "total")


def figures(split: dict[str, list[float]]) -> dict[str, float]:
    """A run's (process -> [compute, loop, other]) as its stage servers' event loops, everything
    but their compute threads ("rest": the per-hop machinery and the trainer), and the total."""
    total = sum(sum(s) for s in split.values())
    compute = sum(s[0] for name, s in split.items() if name != "trainer")
    loops = sum(s[1] for name, s in split.items() if name != "trainer")
    return {"loops": loops, "rest": total - compute, "total": total}


def compared(base: list[dict[str, float]], new: list[dict[str, float]]) -> dict[str, Any]:
    """Each figure's pairs' ratios (new over base, in run order) and medians."""
    out: dict[str, Any] = {}
    for name in FIGURES:
        b, n = [r[name] for r in base], [r[name] for r in new]
        out[name] = {
            "base": statistics.median(b),
            "new": statistics.median(n),
            "pairs": [y / x for x, y in zip(b, n, strict=True)],
        }
    return out


def alternated(base: Path, pairs: int, steps: int, small: bool) -> None:
    """The swarm half of checkout `base` and of this one, alternated, printed as it goes."""
    runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    for i in range(pairs):
        for name in ("base", "new") if i % 2 == 0 else ("new", "base"):
            tree = base if name == "base" else ROOT
            env = {**os.environ, "PYTHONPATH": first_on_path(tree)}
            argv = [sys.executable, "-c", _CHILD, str(steps), "tiny" if small else "full"]
            out = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True)
            if out.returncode:
                raise RuntimeError(f"{name} run failed: {out.stderr[-2000:]}")
            run = figures(json.loads(out.stdout.strip().splitlines()[-1]))
            runs[name].append(run)
            print(name, " ".join(f"{k} {v:.4f}" for k, v in run.items()), flush=True)
    for name, c in compared(runs["base"], runs["new"]).items():
        ratios = ", ".join(f"{r:.3f}" for r in c["pairs"])
        print(f"{name}: base {c['base']:.4f}, new {c['new']:.4f}; pairs {ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="steps a run (4 or more)")
    parser.add_argument("--tiny", action="store_true", help="a d64 model: a smoke run")
    parser.add_argument("--against", type=Path, help="a checkout: its swarm half against this")
    parser.add_argument("--pairs", type=int, default=3, help="with --against: pairs of runs")
    args = parser.parse_args()
    if args.against is not None:
        alternated(args.against, args.pairs, max(args.steps, 4), args.tiny)
        return
    with tempfile.TemporaryDirectory(prefix="swarm-cpu-") as tmp:
        job = Path(tmp) / "job.toml"
        text = JOB.format(steps=args.steps)
        job.write_text(tiny(text) if args.tiny else text)
        swarm = swarm_split(job, max(args.steps, 4), Path(tmp))
        _, ranks = torch_pipeline.run(job, args.steps)
    print(f"{'CPU s a step':<14}{'compute':>9}{'loop':>9}{'other':>9}{'total':>9}")
    for name, s in swarm.items():
        print(f"{name:<14}{s.compute:>9.3f}{s.loop:>9.3f}{s.other:>9.3f}{s.total:>9.3f}")
    compute = sum(s.compute for n, s in swarm.items() if n != "trainer")  # its stages'
    total = sum(s.total for s in swarm.values())
    for r, cpu in enumerate(ranks):
        print(f"{f'torch rank {r}':<14}{'':>27}{cpu:>9.3f}")
    print(f"swarm {total:.3f} (compute threads {compute:.3f}, the rest {total - compute:.3f})")
    print(f"torch {sum(ranks):.3f}; swarm/torch {total / sum(ranks):.3f}")


if __name__ == "__main__":
    main()
