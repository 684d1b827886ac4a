"""Where a swarm step's time went (bench/gpu_ratio.py's swarm runs): the timeline every process
of the run wrote (`swarm.ops.timeline`), read back and cut into steps.

A stage's compute is timed until its device settled (`swarm.device.compute_clock`), so the
union of every server's compute intervals is the time some stage had work on the device; the
rest of the step (`idle`) no stage had any, and the device had nothing to do whatever NVML
says. That idle time is cut where it falls:

- `fill`: from the step's opening (or the step before's end, where that came later: the
  coordinator's record counts a step from there) to the first compute of its microbatches
  (the trainer's lease, its first push, the first hop);
- `gaps`: between computes while the step's microbatches are in flight (hops: gRPC, the
  handover, decoding; a stage waiting on another);
- `drain`: from the last microbatch compute to the commit's start (the answer back up the
  push chain, the trainer's report);
- `commit`: the commit's time (its start to the step applied) less the compute inside it.

`audit wait` (the push plane's audits): from the last push's answer to the step's last
microbatch reported, what the step waited for its last audits (issue 69).

Beside it: `overlap`, the time two or more stages computed at once (on one GPU they share it:
each one's compute is longer for it); `host`, each call's copy of its results to the host after
its compute (`Worker.run_then`'s `after`, the handover's offer included); `queued`, the calls'
waits for their worker; `take`, the handovers received; the recomputed forwards; and each
eviction with its cause (the activation window's `count`, or its `bytes` bound, with the bytes
held and the bound then). `trace.json` is the same events for Perfetto (ui.perfetto.dev) or
chrome://tracing: one row per process and thread of work.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

__all__ = ["breakdown", "chrome_trace", "load", "markdown"]

MICROBATCH_WORK = ("forward", "backward", "forward_backward")


def load(folder: Path) -> dict[int, list[dict[str, Any]]]:
    """pid -> its events, in order (a torn last line, of a process killed mid-write, skipped)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(folder.glob("*.jsonl")):
        events = []
        for line in path.read_text(errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        out[int(path.stem)] = events
    return out


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _at_least_two(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by two or more of `intervals` at once."""
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    total, depth, last = 0.0, 0, 0.0
    for t, d in edges:
        if depth >= 2:
            total += t - last
        depth, last = depth + d, t
    return total


def _clip(a: float, b: float, lo: float, hi: float) -> tuple[float, float] | None:
    a, b = max(a, lo), min(b, hi)
    return (a, b) if b > a else None


def breakdown(
    events: dict[int, list[dict[str, Any]]],
    roles: dict[int, str],
    steps: list[int],
    busy: list[tuple[float, int]] | None = None,
) -> dict[str, Any]:
    """Each of `steps`' breakdown (seconds) and their sum; `roles`: pid -> "trainer" or
    "stage K"; `busy`: NVML samples (time on the timeline's clock, %), for each step's mean."""
    trainer = next((p for p, r in roles.items() if r == "trainer"), None)
    marks = {(e["n"], e.get("step")): e["t0"] for e in events.get(trainer or -1, [])}
    computes = [(pid, e) for pid, evs in events.items() for e in evs if e["n"] == "compute"]
    rows = []
    for step in steps:
        opened, commit = marks.get(("open", step)), marks.get(("commit", step))
        applied = marks.get(("applied", step))
        if opened is None or commit is None or applied is None:
            continue
        # A step's time counts from the later of its opening and the step before's end, as
        # the coordinator's record counts it: the synchronous rule opens a step once the one
        # before is decided, before its APPLYs answered (and delayed_update earlier still).
        opened = max(opened, marks.get(("applied", step - 1), opened))
        work = [
            (pid, e)
            for pid, e in computes
            if e["t1"] > opened and e["t0"] < applied and e.get("at") and e["at"][0] == step
        ]
        spans = [_clip(e["t0"], e["t1"], opened, applied) for _, e in computes]
        inside = [s for s in spans if s is not None]
        mb = [(e["t0"], e["t1"]) for _, e in work if e["fn"] in MICROBATCH_WORK]
        first = max(min((a for a, _ in mb), default=commit), opened)  # begun before: none
        last = max((b for _, b in mb), default=commit)
        during = [c for s in inside if (c := _clip(*s, first, last))]
        in_commit = [c for s in inside if (c := _clip(*s, commit, applied))]
        per_stage: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for pid, e in work:
            per_stage[roles.get(pid, str(pid))][e["fn"]] += e["t1"] - e["t0"]
        row = {
            "step": step,
            "wall": applied - opened,
            "busy": _union(inside),
            "fill": first - opened,
            "gaps": (last - first) - _union(during),
            "drain": max(0.0, commit - last),
            "commit": applied - commit,
            "commit_busy": _union(in_commit),
            "overlap": _at_least_two(inside),
            "host": sum(e["t2"] - e["t1"] for _, e in work if "t2" in e),
            "queued": sum(e["t0"] - e["q"] for _, e in work if "q" in e),
            "per_stage": {k: dict(v) for k, v in sorted(per_stage.items())},
        }
        row["idle"] = row["wall"] - row["busy"]
        row["commit_idle"] = row["commit"] - row["commit_busy"]
        row |= _server_marks(events, roles, opened, applied)
        row |= _trainer_spans(events.get(trainer or -1, []), opened, applied)
        if busy:
            inside_busy = [u for t, u in busy if opened <= t <= applied]
            row["nvml_busy"] = statistics.fmean(inside_busy) if inside_busy else None
        rows.append(row)
    keys = [k for k in (rows[0] if rows else {}) if isinstance(rows[0][k], (int, float))]
    mean = {k: statistics.fmean(r[k] for r in rows if r[k] is not None) for k in keys if rows}
    return {"steps": rows, "mean": mean, "evictions": _evictions(events, roles, steps)}


def _server_marks(
    events: dict[int, list[dict[str, Any]]], roles: dict[int, str], lo: float, hi: float
) -> dict[str, Any]:
    takes, recomputes, evicted = [], 0, 0
    for pid, evs in events.items():
        if roles.get(pid) == "trainer":
            continue
        for e in evs:
            if not lo <= e["t0"] <= hi:
                continue
            if e["n"] == "take":
                takes.append(e["t1"] - e["t0"])
            elif e["n"] == "recompute":
                recomputes += 1
            elif e["n"] == "keep":
                evicted += len(e["evicted"])
    return {
        "takes": len(takes),
        "take_s": sum(takes),
        "recomputes": recomputes,
        "evicted": evicted,
    }


def _trainer_spans(evs: list[dict[str, Any]], lo: float, hi: float) -> dict[str, Any]:
    lat = [e["t1"] - e["t0"] for e in evs if e["n"] == "microbatch" and lo <= e["t0"] <= hi]
    calls = [
        e["t1"] - e["t0"] for e in evs if e["n"] in ("lease", "report") and lo <= e["t0"] <= hi
    ]
    # The push plane's audits (`client.audit.push_audit`): each starts as its push answered,
    # and the step waits for the last to end: its wait is from the last push's answer on.
    audits = [e for e in evs if e["n"] == "audit" and lo <= e["t0"] <= hi]
    ends = [e["t1"] for e in evs if e["n"] == "microbatch" and lo <= e["t0"] <= hi]
    waited = max(ends) - max(e["t0"] for e in audits) if audits and ends else 0.0
    return {
        "microbatch_latency": statistics.fmean(lat) if lat else 0.0,
        "lease_calls": len(calls),
        "audit_wait": max(0.0, waited),
        "reexecutions": sum(e.get("runs", 0) for e in audits),
    }


def _evictions(
    events: dict[int, list[dict[str, Any]]], roles: dict[int, str], steps: list[int]
) -> dict[str, Any]:
    """Every eviction of the run (the warm-up's too: the device fills then), by stage and cause,
    with the window's bound and one microbatch's bytes where it happened."""
    by: Counter[str] = Counter()
    seen: dict[str, dict[str, Any]] = {}
    for pid, evs in events.items():
        role = roles.get(pid, str(pid))
        keeps = [e for e in evs if e["n"] == "keep"]
        for e in keeps:
            for *_key, why in e["evicted"]:  # (step, index, holder), then why
                by[f"{role}: {why}"] += 1
        if keeps:
            seen[role] = {
                "microbatch_bytes": max(e["nbytes"] for e in keeps),
                "bound_min": min(e["bound"] for e in keeps),
                "bound_max": max(e["bound"] for e in keeps),
                "share_min": min(e.get("share", e["bound"]) for e in keeps),
                "held_max": max(e["held"] for e in keeps),
                "entries_max": max(e["entries"] for e in keeps),
            }
    return {"by_cause": dict(sorted(by.items())), "windows": seen}


def markdown(report: dict[str, Any]) -> str:
    """The breakdown as the tables a reader wants first."""
    rows, mean = report["steps"], report["mean"]
    if not rows:
        return "timeline: no timed step was found in the processes' events"
    cols = [
        ("wall", "step s"),
        ("busy", "a stage computing"),
        ("idle", "none computing"),
        ("fill", "fill"),
        ("gaps", "gaps"),
        ("drain", "drain"),
        ("commit", "commit"),
        ("commit_idle", "commit idle"),
        ("overlap", ">=2 computing"),
        ("host", "host copies"),
        ("take_s", "handover takes"),
        ("microbatch_latency", "mb latency"),
        ("audit_wait", "audit wait"),
    ]
    lines = [
        "#### Where a swarm step's time went (seconds; bench/timeline_report.py says how)",
        "| step | " + " | ".join(c for _, c in cols) + " | recomputes | evicted | NVML busy % |",
        "|---:|" + "---:|" * (len(cols) + 3),
    ]
    for r in [*rows, {**mean, "step": "mean"}]:
        nv = r.get("nvml_busy")
        lines.append(
            f"| {r['step']} | "
            + " | ".join(f"{r.get(k, 0.0):.3f}" for k, _ in cols)
            + f" | {r.get('recomputes', 0):.0f} | {r.get('evicted', 0):.0f} | "
            + ("n/a" if nv is None else f"{nv:.0f}")
            + " |"
        )
    stages: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        for stage, fns in r["per_stage"].items():
            for fn, s in fns.items():
                stages[stage][fn].append(s)
    lines.append("")
    lines.append("Compute a step, by stage (seconds, the timed steps' mean):")
    for stage, fns in sorted(stages.items()):
        told = ", ".join(f"{fn} {statistics.fmean(v):.3f}" for fn, v in sorted(fns.items()))
        lines.append(f"- {stage}: {told}")
    ev = report["evictions"]
    lines.append(f"Evictions over the whole run, by stage and cause: {ev['by_cause'] or 'none'}")
    for role, w in sorted(ev["windows"].items()):
        lines.append(
            f"- {role}: a microbatch's activations up to {w['microbatch_bytes'] / 2**20:.0f} MiB; "
            f"window bound {w['bound_min'] / 2**20:.0f}-{w['bound_max'] / 2**20:.0f} MiB "
            f"(its share of the device at least {w['share_min'] / 2**20:.0f} MiB; a bound below "
            "it is the device's free memory less one more forward); "
            f"held at most {w['held_max'] / 2**20:.0f} MiB, {w['entries_max']} microbatches"
        )
    return "\n".join(lines)


def chrome_trace(events: dict[int, list[dict[str, Any]]], roles: dict[int, str]) -> dict:
    """The events in Chrome's trace format (microseconds from the first event)."""
    t0 = min((e["t0"] for evs in events.values() for e in evs), default=0.0)
    out: list[dict[str, Any]] = []
    for pid, evs in events.items():
        out.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": pid,
                "args": {"name": roles.get(pid, str(pid))},
            }
        )
        for e in evs:
            args = {k: v for k, v in e.items() if k not in ("n", "t0", "t1")}
            name = e.get("fn", e["n"])
            if e.get("at"):
                name = f"{name} {e['at'][0]}/{e['at'][1]}"
            if "t1" in e:
                tid = e["n"]  # a row a kind; a trainer's microbatches a row each (they overlap)
                if e["n"] == "microbatch":
                    tid = f"microbatch {e['at'][1]}"
                elif e["n"] in ("lease", "report"):
                    tid = "trainer calls"
                out.append(
                    {
                        "ph": "X",
                        "name": name,
                        "pid": pid,
                        "tid": tid,
                        "ts": (e["t0"] - t0) * 1e6,
                        "dur": (e["t1"] - e["t0"]) * 1e6,
                        "args": args,
                    }
                )
            else:
                out.append(
                    {
                        "ph": "i",
                        "s": "p",
                        "name": name,
                        "pid": pid,
                        "tid": "marks",
                        "ts": (e["t0"] - t0) * 1e6,
                        "args": args,
                    }
                )
    return {"traceEvents": out, "displayTimeUnit": "ms"}
