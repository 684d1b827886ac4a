"""The loss price of local steps (`pool.mode = "local"`, DiLoCo) at equal samples, over seeds.

    .venv/bin/python bench/local_steps.py [--job examples/tiny.toml] [--steps 640]
        [--hs 4,16,32] [--outer 0.7:0.9,0.5:0.9,1.0:0.0] [--overlaps none,eager] [--lrs 3e-3]
        [--seeds 0,1,2]
        [--workers 2] [--json]

For each learning rate and seed, the job trains synchronously (`swarm local`, `pool.mode =
"step"`) and in local mode with 2 replicas of every stage for each round length H (`--hs`,
`pool.sync_every`) and each outer setting (`--outer`, outer_lr:outer_momentum): the synthetic
route record of `swarm local --replicas 2` (SWARM's stochastic wiring, each step's microbatches
spread evenly over the replicas, chains crossing them), the reference every local-mode swarm
run equals float64-exactly; with `--overlaps none,eager` each local row is run with the eager
overlap too (`pool.overlap = "eager"`, the reference's rule: own share at once, the others' a
round late). Both see the same samples at every step. Two scores per run: the
final training loss (the mean of the last 20 steps' losses; in local mode each step's loss is
the replicas' own parameters', between rounds) and the held-out loss of the final shared
parameters, on a set that is the same for every run: the job's validation split
(`swarm.model.reference.evaluate`, drawn with seed 0), or without one 8 training microbatches of
a step 1000 past the run (seed 0), which no run trained on. Per row: the mean over seeds, the
spread (min..max), and the mean against the synchronous mean; the averaging traffic of a row
against synchronous training is 1/H (one average of the parameters per H steps, against one of
the gradients per step). A `bf16-mixed` job runs in fp32 here (as bench/staleness.py). Runs are
independent processes with one thread each, `--workers` at a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swarm.job.config import JobConfig, parse_job  # noqa: E402
from swarm.model.data import DataSource, make_data, make_val_data  # noqa: E402
from swarm.model.local_steps import train_replicas  # noqa: E402
from swarm.model.reference import evaluate, train_local  # noqa: E402
from swarm.ops.progress import StepRecord  # noqa: E402

LAST = 20  # the final loss is the mean over this many last steps (one step's loss is noisy)
REPLICAS = 2  # replicas of every stage in local mode
HELD_OUT_PAST = 1000  # without a validation split: the held-out step is this far past the run
HELD_OUT_MICROBATCHES = 8
HELD_OUT_SEED = 0  # the held-out set's data seed, whatever the run's: one set for every run
SCORES = ("train", "held_out")  # the two scores of a run

# A run: (lr, seed, local setting), the setting None for synchronous or (H, outer_lr, momentum,
# overlap).
Setting = tuple[int, float, float, str] | None
Run = tuple[str, int, Setting]


def _set(text: str, section: str, key: str, value: str) -> str:
    """`key = value` in `[section]`, in place of any `key = ` line (the keys set here occur in one
    section only); the section is appended when the job has none."""
    text = re.sub(rf"^{key} = .*\n", "", text, flags=re.M)
    text, found = re.subn(
        rf"^\[{section}\]$", f"[{section}]\n{key} = {value}", text, count=1, flags=re.M
    )
    return text if found else f"{text.rstrip()}\n\n[{section}]\n{key} = {value}\n"


def job_text(path: Path, steps: int, lr: str, seed: int, setting: Setting) -> str:
    text = path.read_text()
    for key, value in (("steps", str(steps)), ("seed", str(seed)), ("lr", lr)):
        text, found = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, count=1, flags=re.M)
        if not found and key != "lr":
            raise SystemExit(f"{path}: no `{key} = ` line to set")
    # Local mode's validation (JobConfig._check_local): no checkpoints or evaluations off a
    # round's start, the carry data plane (the one that records routes). Both rows get them.
    for key in ("checkpoint_every", "eval_every"):
        text = _set(text, "training", key, "0")
    text = _set(text, "runtime", "data_plane", '"relay"')
    if setting is None:
        text = _set(text, "pool", "mode", '"step"')
    else:
        h, outer_lr, momentum, overlap = setting
        pool: tuple[tuple[str, object], ...] = (
            ("overlap", f'"{overlap}"'),
            ("outer_momentum", momentum),
            ("outer_lr", outer_lr),
            ("sync_every", h),
        )
        for name, chosen in pool:
            text = _set(text, "pool", name, str(chosen))
        text = _set(text, "pool", "mode", '"local"')
    return text.replace('precision = "bf16-mixed"', 'precision = "fp32"')


def _check(path: Path, job: JobConfig, steps: int, seed: int, setting: Setting) -> None:
    """The parsed job is the one asked for (a text edit that missed says so here)."""
    pool = job.pool
    got: tuple[object, ...] = (job.training.steps, job.training.seed, pool.mode)
    want: tuple[object, ...] = (steps, seed, "step" if setting is None else "local")
    if setting is not None:
        got += (pool.sync_every, pool.outer_lr, pool.outer_momentum, pool.overlap)
        want += setting
    if got != want:
        raise SystemExit(f"{path}: the edited job holds {got}, not {want}")


class _PastRun:
    """Microbatch `(step, i)` of `data` is its `(held, i)`: training windows of a step no run
    reaches, for `evaluate` (which draws the validation step)."""

    def __init__(self, data: DataSource, held: int) -> None:
        self.data, self.held = data, held

    def microbatch(self, step: int, index: int):  # type: ignore[no-untyped-def]
        return self.data.microbatch(self.held, index)


def held_out_loss(job: JobConfig, model) -> float:  # type: ignore[no-untyped-def]
    """The loss of `model` on the held-out set, the same for every run of the job (its data
    drawn with seed `HELD_OUT_SEED`): the validation split, else training microbatches of step
    `steps + HELD_OUT_PAST`."""
    training = dataclasses.replace(job.training, seed=HELD_OUT_SEED)
    if job.data.val_fraction or job.data.val_path is not None:
        fixed = dataclasses.replace(job, training=training)
        return evaluate(fixed, model, make_val_data(fixed), "cpu")
    training = dataclasses.replace(training, eval_microbatches=HELD_OUT_MICROBATCHES)
    fixed = dataclasses.replace(job, training=training)
    past = _PastRun(make_data(fixed), job.training.steps + HELD_OUT_PAST)
    return evaluate(fixed, model, past, "cpu")


def score(path: str, steps: int, lr: str, seed: int, setting: Setting) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)  # one core per run: `--workers` runs share the machine evenly
    began = time.perf_counter()
    job = parse_job(job_text(Path(path), steps, lr, seed, setting), Path(path).parent)
    _check(Path(path), job, steps, seed, setting)
    losses: list[float] = []

    def record(r: StepRecord) -> None:
        if r.step < steps:  # not a final evaluation's record
            losses.append(r.loss)

    if setting is None:
        model = train_local(job, on_step=record)
    else:
        model = train_replicas(job, replicas=REPLICAS, on_step=record)
    return {
        "train": statistics.fmean(losses[-LAST:]),
        "held_out": held_out_loss(job, model),
        "seconds": time.perf_counter() - began,
    }


def _name(setting: Setting) -> str:
    if setting is None:
        return "sync"
    h, outer_lr, momentum, overlap = setting
    return f"local H={h} outer {outer_lr}:{momentum}" + (", eager" if overlap == "eager" else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", default=str(ROOT / "examples" / "tiny.toml"))
    parser.add_argument("--steps", type=int, default=640)
    parser.add_argument("--hs", default="4,16,32", help="comma-separated sync_every values")
    parser.add_argument(
        "--outer", default="0.7:0.9,0.5:0.9,1.0:0.0", help="comma-separated outer_lr:outer_momentum"
    )
    parser.add_argument(
        "--overlaps", default="none", help='comma-separated pool.overlap values: "none", "eager"'
    )
    parser.add_argument("--lrs", default="", help="comma-separated; default: the job's own")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    began = time.perf_counter()
    path = Path(args.job).resolve()
    if re.search(r"^\[pool\]$", path.read_text(), flags=re.M):
        print(f"{path}: its [pool] keys are replaced per row", file=sys.stderr)
    own = re.search(r"^lr = (\S+)", path.read_text(), flags=re.M)
    lrs = [x for x in args.lrs.split(",") if x] or ([own.group(1)] if own else [])
    if not lrs:
        raise SystemExit(f"{path}: no `lr = ` line; give --lrs")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    hs = [int(h) for h in args.hs.split(",") if h]
    outers = [tuple(float(x) for x in o.split(":")) for o in args.outer.split(",") if o]
    if any(len(o) != 2 for o in outers):
        raise SystemExit(f"--outer {args.outer}: give outer_lr:outer_momentum pairs")
    overlaps = [x for x in args.overlaps.split(",") if x]
    settings: list[Setting] = [None] + [
        (h, o[0], o[1], overlap) for h in hs for o in outers for overlap in overlaps
    ]
    runs: list[Run] = [(lr, seed, s) for lr in lrs for s in settings for seed in seeds]
    scores: dict[Run, dict[str, float]] = {}
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = {pool.submit(score, str(path), args.steps, *run): run for run in runs}
        for future in as_completed(futures):
            run = futures[future]
            scores[run] = s = future.result()
            print(
                f"[{time.perf_counter() - began:6.0f} s] lr {run[0]} seed {run[1]} "
                f"{_name(run[2])}: train {s['train']:.4f}, held-out {s['held_out']:.4f} "
                f"({s['seconds']:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    rows = []
    for lr in lrs:
        base = {k: statistics.fmean(scores[(lr, seed, None)][k] for seed in seeds) for k in SCORES}
        for setting in settings:
            row: dict[str, object] = {
                "lr": lr,
                "mode": "step" if setting is None else "local",
                "sync_every": 1 if setting is None else setting[0],
                "outer_lr": None if setting is None else setting[1],
                "outer_momentum": None if setting is None else setting[2],
                "overlap": None if setting is None else setting[3],
                "traffic_vs_sync": 1.0 if setting is None else 1 / setting[0],
                "seconds": [scores[(lr, seed, setting)]["seconds"] for seed in seeds],
            }
            for k in SCORES:
                values = [scores[(lr, seed, setting)][k] for seed in seeds]
                row[k] = values
                row[f"{k}_vs_sync"] = statistics.fmean(values) / base[k] - 1
            rows.append(row)
    elapsed = time.perf_counter() - began
    if args.json:
        out = {
            "job": str(path),
            "steps": args.steps,
            "replicas": REPLICAS,
            "seeds": seeds,
            "last": LAST,
            "elapsed_s": elapsed,
            "rows": rows,
        }
        print(json.dumps(out))
        return
    print(
        f"{path.name}, {args.steps} steps, {REPLICAS} replicas per stage in local mode, seeds "
        f"{args.seeds}; train: mean of the last {LAST} steps' losses; held-out: the final shared "
        "parameters' loss on a fixed held-out set; mean over seeds (min..max), vs sync's mean"
    )
    print("| lr | row | traffic vs sync | train loss | vs sync | held-out loss | vs sync |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        traffic = "1" if r["mode"] == "step" else f"1/{r['sync_every']}"
        name = (
            "sync"
            if r["mode"] == "step"
            else f"H={r['sync_every']}, outer {r['outer_lr']}:{r['outer_momentum']}"
            + (", eager" if r["overlap"] == "eager" else "")
        )
        cells = []
        for k in SCORES:
            values: list[float] = r[k]  # type: ignore[assignment]
            spread = f"{statistics.fmean(values):.4f} ({min(values):.4f}..{max(values):.4f})"
            cells.append(f"{spread} | {r[f'{k}_vs_sync']:+.1%}")
        print(f"| {r['lr']} | {name} | {traffic} | {' | '.join(cells)} |")
    print(f"elapsed {elapsed:.0f} s ({args.workers} workers)")


if __name__ == "__main__":
    main()
