"""What lies between two steps on the peer workload: from stage 0's last backward of step t to its
first forward of step t+1, each milestone's offset (ms, the median over the timed steps).

    python bench/step_boundary.py [--steps N] [--tiny]
    python bench/step_boundary.py --against BASE [--pairs N] [--steps N]

The run is bench/small_stages.py's (4 stage servers with one thread each and a trainer, default
settings: one replica a stage), with every process writing its timeline (`swarm.ops.timeline`).
The milestones, in the order a step boundary went through them before issue 69's commit work:

- `answered`: the trainer's last push of step t answered (its `microbatch` span's end);
- `complete`: the coordinator found step t complete (its `commit` mark: blocked from here);
- `prepare sent` / `prepared`: the coordinator's PREPARE round (its `prepare` span, where the
  checkout writes one); each stage's PREPARE on its worker (`prepare` compute: queued, done);
- `apply sent` / `applied all`: the APPLY round (its `apply` span); each stage's optimizer step
  on its worker (`_apply` compute);
- `opened`: step t+1 opened (its `open` mark: no longer blocked);
- `leased`: the trainer's lease of step t+1 answered;
- `s0 forward queued` / `s0 forward`: stage 0's first forward of step t+1 reached its worker,
  and began.

With `--against`, this checkout and BASE alternate (BASE, this, this, BASE, ...), each run
importing its own code; the pairs' gap (stage 0's last backward to its next forward) and the
trainer log's blocked seconds a step are printed with their ratios. A checkout without the
coordinator's spans shows those milestones as absent.
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.small_stages import JOB, first_on_path, tiny  # noqa: E402
from bench.timeline_report import load  # noqa: E402

_CHILD = """
import json, os, sys, subprocess
from pathlib import Path
from swarm.local.procs import start_stage_servers, stop_all
work = Path(sys.argv[1])
job = work / "job.toml"
os.environ["SWARM_TIMELINE"] = str(work / "timeline")
servers = start_stage_servers(job, 4, log_dir=work, threads=1, metrics=False)
try:
    addresses = ",".join(s.address for s in servers)
    args = ["trainer", "--job", str(job), "--threads", "1", "--log", str(work / "trainer.jsonl")]
    trainer = subprocess.Popen(
        [sys.executable, "-m", "swarm.cli", *args, "--stage-servers", addresses],
        stderr=subprocess.DEVNULL,
    )
    roles = {str(s.proc.pid): f"stage {k}" for k, s in enumerate(servers)}
    roles[str(trainer.pid)] = "trainer"
    trainer.wait(timeout=1800)
finally:
    stop_all(servers)
print(json.dumps(roles))
"""


def run(checkout: Path, steps: int, small: bool, work: Path) -> dict[str, Any]:
    """One run of `checkout`'s code: its boundaries (`boundaries`) and blocked seconds a step."""
    env = {**os.environ, "PYTHONPATH": first_on_path(checkout)}
    env.pop("SWARM_TIMELINE", None)
    text = JOB.format(steps=steps)
    (work / "job.toml").write_text(tiny(text) if small else text)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(work)],
        cwd=checkout,
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    roles = {int(p): r for p, r in json.loads(out.stdout.splitlines()[-1]).items()}
    records = [json.loads(x) for x in (work / "trainer.jsonl").read_text().splitlines()][1:]
    events = load(work / "timeline")
    samples = sum(r["samples"] for r in records)
    return {
        "boundaries": boundaries(events, roles),
        "blocked": statistics.median(r.get("blocked_seconds", 0.0) for r in records),
        "samples_per_s": samples / sum(r["seconds"] for r in records),
    }


def _by_role(events: dict[int, list[dict[str, Any]]], roles: dict[int, str]) -> dict[str, Any]:
    return {roles[pid]: evs for pid, evs in events.items() if pid in roles}


def boundaries(
    events: dict[int, list[dict[str, Any]]], roles: dict[int, str]
) -> list[dict[str, float]]:
    """Each step boundary t -> t+1 (t >= 1: step 0 is warm-up), as milestone -> offset in
    seconds from stage 0's last backward of step t."""
    by = _by_role(events, roles)
    trainer, s0 = by["trainer"], by["stage 0"]
    marks = {(e["n"], e.get("step")): e for e in trainer if "step" in e}
    spans: dict[str, list[dict[str, Any]]] = {}
    for e in trainer:
        spans.setdefault(e["n"], []).append(e)
    steps = sorted({step for (n, step) in marks if n == "applied"})
    out = []
    for t in steps[1:]:
        if ("open", t + 1) not in marks:
            continue
        backs = [
            e
            for e in s0
            if e["n"] == "compute" and (e.get("at") or [None])[0] == t and e["fn"] == "backward"
        ]
        fwds = [
            e
            for e in s0
            if e["n"] == "compute" and (e.get("at") or [None])[0] == t + 1 and e["fn"] == "forward"
        ]
        if not backs or not fwds:
            continue
        a = max(e["t1"] for e in backs)
        first = min(fwds, key=lambda e: e["t0"])
        end = first["t0"]
        row: dict[str, float] = {}
        mbs = [e for e in spans.get("microbatch", []) if e["at"][0] == t]
        row["answered"] = max(e["t1"] for e in mbs) - a
        row["complete"] = marks[("commit", t)]["t0"] - a
        for name in ("prepare", "apply"):
            inside = [e for e in spans.get(name, []) if e.get("step") == t]
            if inside:
                row[f"{name} sent"] = inside[-1]["t0"] - a
                row[f"{name} done"] = inside[-1]["t1"] - a
        for role, evs in sorted(by.items()):
            if role == "trainer":
                continue
            for fn in ("prepare", "_apply"):
                done = [
                    e
                    for e in evs
                    if e["n"] == "compute" and e["fn"] == fn and a - 1 < e["t0"] < end
                ]
                if done:
                    e = done[-1]
                    row[f"{role} {fn} queued"] = e["q"] - a
                    row[f"{role} {fn} done"] = e["t1"] - a
        row["opened"] = marks[("open", t + 1)]["t0"] - a
        leases = [
            e
            for e in spans.get("lease", []) + spans.get("report", [])
            if e.get("got") and e["t1"] >= marks[("open", t + 1)]["t0"] and e["t1"] <= end
        ]
        if leases:
            row["leased"] = min(e["t1"] for e in leases) - a
        row["s0 forward queued"] = first["q"] - a
        row["s0 forward"] = end - a
        out.append(row)
    return out


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    return {k: statistics.median(r[k] for r in rows if k in r) for k in keys}


def show(name: str, result: dict[str, Any]) -> None:
    m = medians(result["boundaries"])
    print(
        f"{name}: {result['samples_per_s']:.2f} samples/s, blocked {result['blocked'] * 1e3:.1f}"
        f" ms a step (median), {len(result['boundaries'])} boundaries"
    )
    for k, v in sorted(m.items(), key=lambda kv: kv[1]):
        print(f"  {k:<28} {v * 1e3:8.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="a d64 model: a smoke run")
    parser.add_argument("--against", type=Path, help="a checkout to alternate with")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--work", type=Path, help="keep the run's folder here (one run)")
    args = parser.parse_args()
    if args.against is None:
        if args.work is not None:
            args.work.mkdir(parents=True, exist_ok=True)
            show("this", run(ROOT, args.steps, args.tiny, args.work))
            return
        with tempfile.TemporaryDirectory(prefix="swarm-boundary-") as tmp:
            show("this", run(ROOT, args.steps, args.tiny, Path(tmp)))
        return
    base = args.against.resolve()
    pairs = []
    for i in range(args.pairs):
        order = [("base", base), ("new", ROOT)] if i % 2 == 0 else [("new", ROOT), ("base", base)]
        got = {}
        for name, checkout in order:
            with tempfile.TemporaryDirectory(prefix="swarm-boundary-") as tmp:
                got[name] = run(checkout, args.steps, args.tiny, Path(tmp))
            show(f"pair {i} {name}", got[name])
        gap = {n: medians(r["boundaries"])["s0 forward"] for n, r in got.items()}
        pairs.append(
            {
                "gap": (gap["base"], gap["new"]),
                "blocked": (got["base"]["blocked"], got["new"]["blocked"]),
                "rate": (got["base"]["samples_per_s"], got["new"]["samples_per_s"]),
            }
        )
        p = pairs[-1]
        print(
            f"pair {i}: gap {p['gap'][0] * 1e3:.1f} -> {p['gap'][1] * 1e3:.1f} ms, blocked "
            f"{p['blocked'][0] * 1e3:.1f} -> {p['blocked'][1] * 1e3:.1f} ms, samples/s new/base "
            f"{p['rate'][1] / p['rate'][0]:.3f}",
            flush=True,
        )
    for key in ("gap", "blocked", "rate"):
        ratios = [p[key][1] / p[key][0] for p in pairs]
        print(f"median new/base {key}: {statistics.median(ratios):.3f} ({ratios})")
    print("RESULT " + json.dumps(pairs))


if __name__ == "__main__":
    main()
