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
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from small_stages import JOB as PEER_WORKLOAD  # noqa: E402
from small_stages import tiny  # noqa: E402  (bench/ is the script's own path)

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


def child(
    steps: int, work: Path, fraction: float, replicas: int, smoke: bool, ready_s: float
) -> None:
    """One run: `replicas` stage servers a stage and a trainer; prints seconds a step. A
    server not serving within `ready_s` fails the run."""
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
        subprocess.run(
            [sys.executable, "-m", "swarm.cli", *trainer, "--stage-servers", stages],
            check=True,
            stderr=subprocess.DEVNULL,
            timeout=3600,
        )
    finally:
        stop_all(servers)
    # the steps trained (a final evaluation, where there is one, is none), less the warm-up and
    # the job's last step, which waits for its audits
    steps_run = [json.loads(line) for line in log.read_text().splitlines()]
    records = [r for r in steps_run if r.get("samples", 1)][1:-1]
    print(sum(r["seconds"] for r in records) / len(records))


class Runner(Protocol):
    """One run's seconds a step (`run`; the tests give canned ones)."""

    def __call__(self, steps: int, fraction: float, replicas: int) -> float: ...


def run(steps: int, fraction: float, replicas: int, smoke: bool = False) -> float:
    """Seconds a step of one run in a process of its own (`smoke`: of the d64 model)."""
    with tempfile.TemporaryDirectory(prefix="swarm-audit-cost-") as tmp:
        for copy in range(replicas):
            (Path(tmp) / str(copy)).mkdir()
        args = [sys.executable, __file__, "--child", tmp, "--steps", str(steps)]
        args += ["--fraction", str(fraction), "--replicas", str(replicas)]
        args += ["--tiny"] if smoke else []
        out = subprocess.run(args, capture_output=True, text=True, timeout=3600)
    if out.returncode:  # its own error, said where the bench's log shows it
        raise RuntimeError(f"a run failed (exit status {out.returncode}):\n{out.stderr[-3000:]}")
    return float(out.stdout.split()[-1])


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
    parser.add_argument("--ready-s", type=float, default=120.0, help=argparse.SUPPRESS)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error(f"--steps {args.steps}: the first and the last are not counted; 3 or more")
    if args.child:
        child(args.steps, args.child, args.fraction, args.replicas, args.tiny, args.ready_s)
        return 0
    timed: Runner = runner or (lambda steps, f, r: run(steps, f, r, args.tiny))
    if args.pairs < MIN_PAIRS:
        parser.error(f"--pairs {args.pairs}: the score takes {MIN_PAIRS} or more")
    print(f"{args.replicas} replicas a stage, push plane, audit_fraction {args.fraction} vs 0")
    print(f"{'pair':<5} {'on s/step':>10} {'off s/step':>11} {'on/off':>7}", flush=True)
    pairs = []
    for i in range(args.pairs):
        order = [args.fraction, 0.0] if i % 2 == 0 else [0.0, args.fraction]
        got = {f: timed(args.steps, f, args.replicas) for f in order}
        pairs.append((got[args.fraction], got[0.0]))
        on, off = pairs[-1]
        print(f"{i:<5} {on:>10.3f} {off:>11.3f} {on / off:>7.3f}", flush=True)
    scored = score(pairs)
    verdict = "PASS" if scored.passed else "FAIL"
    print(f"{verdict}: audits on/off median {scored.median:.3f} (target <= {scored.limit})")
    return 0 if scored.passed else 1


if __name__ == "__main__":
    sys.exit(main())
