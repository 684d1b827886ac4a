"""Standby cost (issue 67, item 3): seconds a step of a swarm whose every stage has a standby
(`runtime.standby = 1`: a peer of its own host that follows the stage's updates and serves
nothing) against the same swarm without one, unshaped and with each host's link at `--rate`, on
the peer workload (bench/wan.py's `d256`). Each run is one `bench/wan.py --json` (its unshaped
run, then its shaped one, on fresh servers): `--replicas R` without, `--replicas R+1
--standby 1` with, alternated (with, without, without, with, ...) so that a machine that drifts
weighs on both alike. The score, for each link, is the median of the pairs' with/without ratios
of seconds a step; the target is at most 1.05 on both (a standby costs the pool at most 5%), and
the bench exits 1 when it is missed, 2 when wan.py cannot run (it needs root).

    sudo .venv/bin/python bench/standby_cost.py [--pairs 3] [--replicas 1]
        [--averaging none|fp16|bf16|int8_blockwise] [--rate 100mbit] [--steps 10] [--tiny]

It also prints what each stage's standby received a step (its host's link, as tbf counts it:
segment headers included), which is the pool's summed gradient in the codec of its averaging
(`--averaging`, with `--replicas` 2 or more; a pool of one averages nothing, and its standby
receives the float32 sum), and the machine's load average as each run started. Every process of
a run needs a core of its own for the seconds a step to say anything (d256: 9 with a standby at
`--replicas 1`, 13 at 2); on a machine shared with other work, or with fewer cores, a standby's
own compute takes cores from the replicas, and the wall ratio judges the machine, not the
standby.

So it prints beside them what holds on a shared host: CPU seconds a step (user + system, each
process's over wan.py's timed window, `bench.proc_cpu`), medians of the pairs' ratios as the
wall's are. "standby": each standby process's own CPU a step (what it takes of a host; on a
host of its own, nothing of the pool's). "source": the CPU a step of each standby's source, the
serving replica of its stage that sent most over the window (it sends the update on top of its
share of the averaging; with `--replicas 1`, the stage's one replica), over that of its stage's
replicas without a standby (their mean): the cost of serving the update. "swarm": every
process's CPU a step with a standby over without, the standbys' included; "serving": the same
less the standbys, what the pool and the trainer spend. With a core a process, the seconds a
step follow the critical path, which a standby's source is on: its CPU ratio bounds what the
update costs the step, where the wall ratio cannot be had. The verdict is still the wall's.
`--tiny` runs wan.py's `tiny` workload instead: a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 1.05  # with/without seconds a step, the median of the pairs, on each link
MIN_PAIRS = 3
LINKS = ("unshaped", "shaped")


class CannotRun(Exception):
    """bench/wan.py said it cannot run here (exit status 2: not root, no `tc`, ...)."""


@dataclass(frozen=True)
class Score:
    """Each link's with/without ratios of seconds a step, their medians, and whether each keeps
    to `limit`."""

    ratios: dict[str, list[float]]
    medians: dict[str, float]
    limit: float

    @property
    def passed(self) -> bool:
        return all(m <= self.limit for m in self.medians.values())


def seconds_a_step(run: dict[str, Any], link: str) -> float:
    m = run[link]
    return float(m["seconds"]) / int(m["steps"])


def score(pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]], limit: float = LIMIT) -> Score:
    """`pairs`: (wan.py's report with a standby, without), one per alternated pair of runs.
    Refused (ValueError) with fewer than `MIN_PAIRS`, or a step's time that is not positive."""
    if len(pairs) < MIN_PAIRS:
        raise ValueError(f"{len(pairs)} pairs; the score takes the median of {MIN_PAIRS} or more")
    ratios: dict[str, list[float]] = {link: [] for link in LINKS}
    for with_, without in pairs:
        for link in LINKS:
            a, b = seconds_a_step(with_, link), seconds_a_step(without, link)
            if not (a > 0 and b > 0):
                raise ValueError(f"a step's seconds must be positive: {a}, {b} ({link})")
            ratios[link].append(a / b)
    medians = {link: statistics.median(r) for link, r in ratios.items()}
    return Score(ratios, medians, limit)


def standby_bytes(run: dict[str, Any], link: str) -> dict[int, tuple[str, float]]:
    """Each stage's standby host (of `s<k>r<j>`, the one that sent least: it serves nothing)
    and the bytes it received a step on `link`."""
    per_mb = run[link]["bytes_per_microbatch"]
    microbatches = int(run["workload"]["microbatches"])
    out: dict[int, tuple[str, float]] = {}
    for k in range(int(run["workload"]["stages"])):
        hosts = [h for h in per_mb if h.startswith(f"s{k}r")]
        if len(hosts) < 2:
            continue  # one server a stage: no standby
        host = min(hosts, key=lambda h: per_mb[h]["sent"])
        out[k] = (host, per_mb[host]["received"] * microbatches)
    return out


def stage_hosts(run: dict[str, Any], link: str, stage: int) -> list[str]:
    """The hosts of `stage`'s servers in a run: `stage<k>` with one a stage, else `s<k>r<j>`."""
    hosts = run[link]["bytes_per_microbatch"]
    return [h for h in hosts if h == f"stage{stage}" or h.startswith(f"s{stage}r")]


def sources(run: dict[str, Any], link: str) -> dict[int, str]:
    """Each stage's standby's source: of its serving hosts (its standby's left out), the one
    that sent most on `link` (the update it sends its standby comes on top of the averaging)."""
    per_mb, out = run[link]["bytes_per_microbatch"], {}
    for k, (standby, _) in standby_bytes(run, link).items():
        serving = [h for h in stage_hosts(run, link, k) if h != standby]
        out[k] = max(serving, key=lambda h: per_mb[h]["sent"])
    return out


@dataclass(frozen=True)
class CpuCost:
    """One pair's CPU seconds a step on one link (the module's docstring): each stage's
    standby's own; its source's with over its stage's replicas' without; the swarm's with over
    without, and the same less the standbys ("serving"); the swarm's CPU seconds a step
    without (what the ratios are of)."""

    standby: dict[int, float]
    source: dict[int, float]
    swarm: float
    serving: float
    swarm_without: float


def cpu_cost(with_: dict[str, Any], without: dict[str, Any], link: str) -> CpuCost | None:
    """The pair's `CpuCost` on `link`; None when a report has no CPU figures (an older
    wan.py's) or a run's CPU is not positive."""
    a = with_[link].get("cpu_seconds_per_step")
    b = without[link].get("cpu_seconds_per_step")
    if not a or not b or sum(a.values()) <= 0 or sum(b.values()) <= 0:
        return None
    standbys = {k: host for k, (host, _) in standby_bytes(with_, link).items()}
    source = {}
    for k, host in sources(with_, link).items():
        alone = [b[h] for h in stage_hosts(without, link, k) if h in b]
        if alone and statistics.mean(alone) > 0:
            source[k] = a[host] / statistics.mean(alone)
    standing = sum(a[h] for h in standbys.values())
    return CpuCost(
        standby={k: a[h] for k, h in standbys.items()},
        source=source,
        swarm=sum(a.values()) / sum(b.values()),
        serving=(sum(a.values()) - standing) / sum(b.values()),
        swarm_without=sum(b.values()),
    )


def cpu_medians(costs: Sequence[CpuCost]) -> dict[str, float]:
    """The pairs' medians of each `CpuCost` figure (a pair's standby and source: the mean of
    its stages')."""
    return {
        "standby": statistics.median(statistics.mean(c.standby.values()) for c in costs),
        "source": statistics.median(statistics.mean(c.source.values()) for c in costs),
        "swarm": statistics.median(c.swarm for c in costs),
        "serving": statistics.median(c.serving for c in costs),
        "swarm_without": statistics.median(c.swarm_without for c in costs),
    }


def cpu_said(cost: CpuCost | None) -> str:
    """A pair's CPU columns: swarm and serving ratios, the source's (stages' mean), and each
    standby's CPU seconds a step (mean)."""
    if cost is None or not cost.standby or not cost.source:
        return f"{'-':>9} {'-':>8} {'-':>7} {'-':>9}"
    source, standby = statistics.mean(cost.source.values()), statistics.mean(cost.standby.values())
    return f"{cost.swarm:>9.3f} {cost.serving:>8.3f} {source:>7.3f} {standby:>9.3f}"


class Runner(Protocol):
    """One wan.py run's report (`run`; the tests give canned ones)."""

    def __call__(self, standby: bool) -> dict[str, Any]: ...


@dataclass
class Wan:
    """Runs bench/wan.py as its own process, with the bench's options."""

    args: argparse.Namespace
    loads: list[float] = field(default_factory=list)  # the 1-minute load average at each start

    def __call__(self, standby: bool) -> dict[str, Any]:
        a = self.args
        replicas = a.replicas + (1 if standby else 0)
        argv = [sys.executable, str(ROOT / "bench" / "wan.py"), "--json", "--rate", a.rate]
        argv += ["--replicas", str(replicas), "--standby", "1" if standby else "0"]
        argv += ["--averaging", a.averaging, "--steps", str(a.steps)]
        argv += ["--workload", "tiny" if a.tiny else "d256"]
        self.loads.append(os.getloadavg()[0])
        out = subprocess.run(argv, capture_output=True, text=True, timeout=a.timeout)
        if out.returncode == 2:
            raise CannotRun(out.stderr.strip()[-2000:])
        if out.returncode:
            raise RuntimeError(
                f"wan.py failed (exit status {out.returncode}):\n{out.stderr[-3000:]}"
            )
        return json.loads(out.stdout)  # type: ignore[no-any-return]


def mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def main(argv: Sequence[str] | None = None, runner: Runner | None = None) -> int:
    """The bench; `runner` gives a run's report (None: `Wan`, wan.py in a process of its own)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=MIN_PAIRS, help="alternated pairs of runs")
    parser.add_argument("--replicas", type=int, default=1, help="replicas a stage (serving)")
    parser.add_argument("--averaging", default="none", help="compression.averaging of the job")
    parser.add_argument("--rate", default="100mbit", help="each host's link in the shaped run")
    parser.add_argument("--steps", type=int, default=10, help="timed steps a run (wan.py's)")
    parser.add_argument("--tiny", action="store_true", help="wan.py's tiny workload: a smoke run")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds a run may take")
    args = parser.parse_args(argv)
    if args.pairs < MIN_PAIRS:
        parser.error(f"--pairs {args.pairs}: the score takes {MIN_PAIRS} or more")
    wan = Wan(args)
    timed: Runner = runner or wan
    workload = "tiny" if args.tiny else "d256"
    print(
        f"{workload}: {args.replicas} replica(s) a stage with a standby each vs without; "
        f"averaging {args.averaging}; unshaped and {args.rate}"
    )
    print(
        f"{'pair':<5} {'link':<9} {'with s/step':>12} {'without':>9} {'ratio':>7}   "
        f"{'CPU swarm':>9} {'serving':>8} {'source':>7} {'standby s':>9}   "
        "each standby's bytes a step",
        flush=True,
    )
    pairs = []
    costs: dict[str, list[CpuCost]] = {link: [] for link in LINKS}
    try:
        for i in range(args.pairs):
            order = [True, False] if i % 2 == 0 else [False, True]
            got = {standby: timed(standby) for standby in order}
            pairs.append((got[True], got[False]))
            for link in LINKS:
                a, b = seconds_a_step(got[True], link), seconds_a_step(got[False], link)
                took = standby_bytes(got[True], link)
                said = ", ".join(f"{k}: {mb(n)}" for k, (_, n) in sorted(took.items()))
                cost = cpu_cost(got[True], got[False], link)
                if cost is not None and cost.standby and cost.source:
                    costs[link].append(cost)
                cpu = cpu_said(cost)
                print(
                    f"{i:<5} {link:<9} {a:>12.3f} {b:>9.3f} {a / b:>7.3f}   {cpu}   {said}",
                    flush=True,
                )
    except CannotRun as e:
        print(f"bench/standby_cost.py: wan.py cannot run here: {e}", file=sys.stderr)
        return 2
    if wan.loads:
        loads = ", ".join(f"{x:.1f}" for x in wan.loads)
        print(f"load average (1 min) as each run started: {loads} ({os.cpu_count()} cores)")
    for link, cs in costs.items():
        if cs:
            m = cpu_medians(cs)
            print(
                f"CPU a step, {link}, median of {len(cs)} pairs: swarm with/without "
                f"{m['swarm']:.3f}, serving (less the standbys) {m['serving']:.3f}, each "
                f"standby's source {m['source']:.3f}; a standby's own {m['standby']:.3f} s "
                f"(the swarm's without: {m['swarm_without']:.2f} s)"
            )
    scored = score(pairs)
    verdict = "PASS" if scored.passed else "FAIL"
    medians = ", ".join(f"{link} {m:.3f}" for link, m in scored.medians.items())
    print(f"{verdict}: with a standby / without, median s/step {medians} (target <= {LIMIT})")
    return 0 if scored.passed else 1


if __name__ == "__main__":
    sys.exit(main())
