"""Audit cost (issue 69, item 4): seconds a step of the peer workload (byte GPT d256, 8 blocks,
seq 128, 4 stages, microbatch 8, 8 microbatches a step, AdamW, push plane) on REPLICAS stage
servers a stage and one trainer, one thread each, with audits on (`[trust] audit_fraction`, the
default 0.045) against off (0), run alternately in one sitting. The score is the median of the
pairs' on/off ratios; the target is at most 1.03 (a step with audits on costs at most 3% more),
and the bench exits 1 when it is missed.

    .venv/bin/python bench/audit_cost.py [--pairs N] [--steps N] [--replicas N] [--fraction F]
        [--tiny]

The runs alternate (on, off, off, on, on, off, ...) so a machine that drifts slower or faster
weighs on both alike; the first step of each run is warm-up and not counted, nor is the last:
the job's last step waits for its audits and every late one before it (no later commit bounds
them, `client.audit.late_audits`), a cost of the job's end, not of a step. At least
`MIN_PAIRS` pairs. Speed belongs on a quiet machine: a figure from one shared with other work
says nothing about the target (the ratios' spread shows it). The last line says PASS or FAIL
with the median; `--tiny` runs a d64 model instead, a smoke run whose figure judges nothing.

Beside each run's seconds a step, its CPU seconds a step (utime + stime of every thread of the
stage servers and of the trainer, from /proc, over the timed steps: `bench.audit_split`), and
the medians of the pairs' on/off ratios of those: on a machine with fewer cores than processes
every re-execution's CPU is taken from the stage servers, so the wall ratio there is the CPU's,
not what separate machines would see. `--profile DIR` samples every process with py-spy over
the same steps and splits the CPU by what audits spend (re-execution, digests, records kept,
records fetched, the trainer's audits, the rest; `bench.audit_split`), each run's raw stacks
kept in DIR. `--code CHECKOUT` runs the servers and the trainer from another checkout's code
(its swarm first on their PYTHONPATH; the bench's own code stays this one's): a before/after.
`--figures-only` allows fewer pairs than `MIN_PAIRS` and gives the figures without a verdict.
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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from audit_split import PARTS, Spied  # noqa: E402  (bench/ is the script's own path)
from small_stages import JOB as PEER_WORKLOAD  # noqa: E402
from small_stages import first_on_path, tiny  # noqa: E402

LIMIT = 1.03  # on/off, the median of the pairs: at most 3% more a step with audits on
MIN_PAIRS = 5

# The peer workload as bench/small_stages.py runs it, on the push plane, audits at `fraction`
# (its [runtime] table is its last: the plane joins it)
JOB = PEER_WORKLOAD + 'data_plane = "push"\n[trust]\naudit_fraction = {fraction}\n'


@dataclass(frozen=True)
class Score:
    """The pairs' on/off ratios, their median, and whether it keeps to `limit`."""

    ratios: list[float]
    median: float
    limit: float

    @property
    def passed(self) -> bool:
        return self.median <= self.limit


def score(pairs: Sequence[tuple[float, float]], limit: float = LIMIT) -> Score:
    """`pairs`: (seconds a step with audits on, off), one per alternated pair of runs. Refused
    (ValueError) with fewer than `MIN_PAIRS`, or a time that is not positive."""
    if len(pairs) < MIN_PAIRS:
        raise ValueError(f"{len(pairs)} pairs; the score takes the median of {MIN_PAIRS} or more")
    if any(not (on > 0 and off > 0) for on, off in pairs):
        raise ValueError(f"a step's seconds must be positive: {list(pairs)}")
    ratios = [on / off for on, off in pairs]
    return Score(ratios, statistics.median(ratios), limit)


@dataclass(frozen=True)
class Run:
    """One run's seconds a step, its CPU seconds a step (the stage servers' together, the
    trainer's), and, where py-spy sampled it, that CPU by part (`audit_split.PARTS`:
    part -> (servers', trainer's))."""

    seconds: float
    servers: float = 0.0
    trainer: float = 0.0
    parts: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def cpu(self) -> float:
        return self.servers + self.trainer


def child(
    steps: int,
    work: Path,
    fraction: float,
    replicas: int,
    smoke: bool,
    ready_s: float,
    profile: Path | None = None,
) -> None:
    """One run: `replicas` stage servers a stage and a trainer; prints its `Run` as JSON. A
    server not serving within `ready_s` fails the run. `profile`: py-spy's stacks go there."""
    from swarm.local.procs import SwarmProcess, start_stage_servers, stop_all

    job = work / "job.toml"
    text = JOB.format(steps=steps, fraction=fraction)
    job.write_text(tiny(text) if smoke else text)
    log = work / "trainer.jsonl"

    def copy_of_the_stages(copy: int) -> list[SwarmProcess]:
        logs = work / str(copy)
        return start_stage_servers(job, 4, log_dir=logs, threads=1, metrics=False, timeout=ready_s)

    # the copies start together: a run's start-up is one server's, not `replicas` in a row
    with ThreadPoolExecutor(replicas) as starting:
        started = [starting.submit(copy_of_the_stages, copy) for copy in range(replicas)]
    servers = [server for copy in started if not copy.exception() for server in copy.result()]
    errors = [e for e in (copy.exception() for copy in started) if e is not None]
    if errors:  # a copy that did not start: the others stopped, its error told
        stop_all(servers)
        raise errors[0]
    try:
        stages = ",".join("|".join(s.address for s in servers[k::4]) for k in range(4))
        trainer = ["trainer", "--job", str(job), "--threads", "1", "--log", str(log)]
        proc = subprocess.Popen(
            [sys.executable, "-m", "swarm.cli", *trainer, "--stage-servers", stages],
            stderr=subprocess.DEVNULL,
        )
        pids = {f"stage{k % 4}-{k // 4}": s.proc.pid for k, s in enumerate(servers)}
        pids["trainer"] = proc.pid
        spied = Spied(pids, profile)
        # the timed steps' window: from the warm-up's record to the last counted one's
        _await_records(log, 1, proc)
        spied.start()
        _await_records(log, steps - 1, proc)
        cpu, parts = spied.stop(steps - 2)
        if proc.wait(timeout=3600):
            raise RuntimeError(f"the trainer failed (exit status {proc.returncode})")
    finally:
        stop_all(servers)
    # the steps trained (a final evaluation, where there is one, is none), less the warm-up and
    # the job's last step, which waits for its audits
    steps_run = [json.loads(line) for line in log.read_text().splitlines()]
    records = [r for r in steps_run if r.get("samples", 1)][1:-1]
    seconds = sum(r["seconds"] for r in records) / len(records)
    on_servers = [name for name in pids if name != "trainer"]
    by_part = {
        part: (sum(parts[n][part] for n in on_servers if n in parts), parts["trainer"][part])
        for part in PARTS
        if "trainer" in parts
    }
    run = Run(seconds, sum(cpu[n] for n in on_servers), cpu["trainer"], by_part)
    print(json.dumps(asdict(run)))


def _await_records(log: Path, records: int, trainer: subprocess.Popen[bytes]) -> None:
    """Until the trainer's log holds `records` steps (its end before that: an error)."""
    while (len(log.read_text().splitlines()) if log.exists() else 0) < records:
        if trainer.poll() is not None:
            raise RuntimeError(f"the trainer ended (status {trainer.returncode}) at {records}")
        time.sleep(0.05)


class Runner(Protocol):
    """One run's `Run` (`run`; the tests give canned ones)."""

    def __call__(self, steps: int, fraction: float, replicas: int) -> Run: ...


def run(
    steps: int,
    fraction: float,
    replicas: int,
    smoke: bool = False,
    profile: Path | None = None,
    code: Path | None = None,
    ready_s: float = 120.0,
) -> Run:
    """One run in a process of its own (`smoke`: of the d64 model; `profile`: py-spy's stacks
    into that folder; `code`: the servers and the trainer from that checkout; `ready_s`: how
    long a server may take to serve)."""
    with tempfile.TemporaryDirectory(prefix="swarm-audit-cost-") as tmp:
        for copy in range(replicas):
            (Path(tmp) / str(copy)).mkdir()
        args = [sys.executable, __file__, "--child", tmp, "--steps", str(steps)]
        args += ["--fraction", str(fraction), "--replicas", str(replicas)]
        args += ["--ready-s", str(ready_s)] + (["--tiny"] if smoke else [])
        args += ["--profile", str(profile)] if profile is not None else []
        env = {**os.environ, "PYTHONPATH": first_on_path(code)} if code is not None else None
        # in the checkout: `python -m` puts the working directory first on a process's path
        out = subprocess.run(args, capture_output=True, text=True, timeout=3600, env=env, cwd=code)
    if out.returncode:  # its own error, said where the bench's log shows it
        raise RuntimeError(f"a run failed (exit status {out.returncode}):\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got["parts"] = {part: tuple(v) for part, v in got["parts"].items()}
    return Run(**got)


def cpu_report(pairs: Sequence[tuple[Run, Run]]) -> list[str]:
    """The CPU lines: each side's median CPU seconds a step (the stage servers', the
    trainer's, all), the medians of the pairs' on/off ratios of each, and, where py-spy
    sampled the runs, the median CPU seconds a step of each part, on against off."""
    lines = []
    for what, of in (
        ("servers", lambda r: r.servers),
        ("trainer", lambda r: r.trainer),
        ("all", lambda r: r.cpu),
    ):
        on = statistics.median(of(a) for a, _ in pairs)
        off = statistics.median(of(b) for _, b in pairs)
        ratio = statistics.median(of(a) / of(b) if of(b) else float("nan") for a, b in pairs)
        lines.append(
            f"CPU s/step {what:<8} on {on:7.3f}  off {off:7.3f}  on/off median {ratio:.3f}"
        )
    sampled = [(a, b) for a, b in pairs if a.parts and b.parts]
    if sampled:
        head = ("servers on", "off", "trainer on", "off", "on-off")
        lines.append(f"{'CPU s/step by part':<19}" + "".join(f"{h:>11}" for h in head))
    for part in PARTS if sampled else ():
        s_on, s_off, t_on, t_off = (
            statistics.median(side[part][i] for side in sides)
            for i in (0, 1)
            for sides in ([a.parts for a, _ in sampled], [b.parts for _, b in sampled])
        )
        figures = (s_on, s_off, t_on, t_off, s_on + t_on - s_off - t_off)
        lines.append(f"{part:<19}" + "".join(f"{x:>11.4f}" for x in figures))
    return lines


def main(argv: Sequence[str] | None = None, runner: Runner | None = None) -> int:
    """The bench; `runner` times a run (None: `run`, a process of its own)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=MIN_PAIRS, help="alternated pairs of runs")
    parser.add_argument(
        "--steps", type=int, default=7, help="steps per run (the first and the last not counted)"
    )
    parser.add_argument("--replicas", type=int, default=3, help="stage servers a stage")
    parser.add_argument("--fraction", type=float, default=0.045, help="audit_fraction when on")
    parser.add_argument("--tiny", action="store_true", help="a d64 model: a smoke run")
    parser.add_argument("--profile", type=Path, help="py-spy every process; its stacks here")
    parser.add_argument("--code", type=Path, help="the servers and trainer from this checkout")
    parser.add_argument(
        "--figures-only", action="store_true", help="fewer pairs allowed; no verdict"
    )
    parser.add_argument("--ready-s", type=float, default=120.0, help=argparse.SUPPRESS)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error(f"--steps {args.steps}: the first and the last are not counted; 3 or more")
    if args.child:
        child(
            args.steps,
            args.child,
            args.fraction,
            args.replicas,
            args.tiny,
            args.ready_s,
            args.profile,
        )
        return 0
    if args.pairs < (1 if args.figures_only else MIN_PAIRS):
        parser.error(f"--pairs {args.pairs}: the score takes {MIN_PAIRS} or more")
    runs = iter(range(2 * args.pairs))

    def timed(steps: int, fraction: float, replicas: int) -> Run:
        folder = None
        if args.profile is not None:  # each run's stacks in a folder of its own
            folder = args.profile / f"{next(runs)}-{'on' if fraction else 'off'}"
            folder.mkdir(parents=True, exist_ok=True)
        return run(steps, fraction, replicas, args.tiny, folder, args.code, args.ready_s)

    timer: Runner = runner or timed
    print(f"{args.replicas} replicas a stage, push plane, audit_fraction {args.fraction} vs 0")
    if args.code is not None:
        print(f"the servers and the trainer from {args.code}")
    head = f"{'pair':<5} {'on s/step':>10} {'off s/step':>11} {'on/off':>7}"
    print(f"{head} {'on CPU/step':>12} {'off CPU/step':>13} {'CPU on/off':>11}", flush=True)
    pairs: list[tuple[Run, Run]] = []
    for i in range(args.pairs):
        order = [args.fraction, 0.0] if i % 2 == 0 else [0.0, args.fraction]
        got = {f: timer(args.steps, f, args.replicas) for f in order}
        on, off = got[args.fraction], got[0.0]
        pairs.append((on, off))
        ratio = on.cpu / off.cpu if off.cpu else float("nan")
        print(
            f"{i:<5} {on.seconds:>10.3f} {off.seconds:>11.3f} {on.seconds / off.seconds:>7.3f} "
            f"{on.cpu:>12.3f} {off.cpu:>13.3f} {ratio:>11.3f}",
            flush=True,
        )
    for line in cpu_report(pairs):
        print(line)
    seconds = [(on.seconds, off.seconds) for on, off in pairs]
    if len(pairs) < MIN_PAIRS:
        median = statistics.median(a / b for a, b in seconds)
        print(f"FIGURES ONLY ({len(pairs)} pairs, no verdict): audits on/off median {median:.3f}")
        return 0
    scored = score(seconds)
    verdict = "PASS" if scored.passed else "FAIL"
    print(f"{verdict}: audits on/off median {scored.median:.3f} (target <= {scored.limit})")
    return 0 if scored.passed else 1


if __name__ == "__main__":
    sys.exit(main())
