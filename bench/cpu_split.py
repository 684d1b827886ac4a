"""Where the peer workload's CPU goes, a step: each swarm process's threads (its compute thread,
its event loop, the rest: gRPC's) against torch pipelining's ranks, in CPU seconds a step.

    python bench/cpu_split.py [--steps N] [--tiny]

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
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import torch_pipeline  # noqa: E402
from bench.small_stages import JOB, first_on_path, tiny  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def stat_seconds(stat: str) -> float:
    """utime + stime of a /proc/.../stat line, in seconds (the name may hold spaces and ')')."""
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICK


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


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="steps a run (4 or more)")
    parser.add_argument("--tiny", action="store_true", help="a d64 model: a smoke run")
    args = parser.parse_args()
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
