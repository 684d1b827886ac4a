"""The loss price of `training.delayed_update` (one step of staleness), over seeds and rates, and
of its eager rule.

    .venv/bin/python bench/staleness.py [--job examples/tiny.toml] [--steps 300]
        [--lrs 3e-4,3e-3] [--seeds 0,1,2] [--workers 2] [--eager] [--json]

For each learning rate and seed, `swarm local` (the reference every swarm run equals within 1e-9
in float64) trains the job twice, synchronously and with `delayed_update = true`, and prints the
final loss of each (the mean of the last 20 steps' training losses) and the delayed runs' mean
against the synchronous runs' mean. `--eager` adds a third run: delayed_update with
`pool.overlap = "eager"` (each replica applies its own fresh gradient share at once and the
others' one step late: `swarm local --replicas 2`, swarm/model/local_steps.py), whose samples
and wiring are those of 2 replicas a stage (each replica takes half of each step's microbatches
at each stage, chains crossing replicas). The seeds matter: at a rate where the synchronous run
escapes a plateau at a seed-dependent step, one seed's ratio says little; the spread of the
synchronous runs is printed beside it. A `bf16-mixed` job runs in fp32 here (same recipe
otherwise): autocast on a CPU is slow and the price is the optimizer's, not the precision's.
Runs are independent processes with one thread each, `--workers` at a time.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swarm.job.config import parse_job  # noqa: E402
from swarm.model.local_steps import train_replicas  # noqa: E402
from swarm.model.reference import train_local  # noqa: E402
from swarm.ops.progress import StepRecord  # noqa: E402

LAST = 20  # the final loss is the mean over this many last steps (one step's loss is noisy)


RULES = ("synchronous", "delayed", "eager")


def job_text(path: Path, steps: int, lr: str, seed: int, delayed: bool, eager: bool = False) -> str:
    text = path.read_text()
    for key, value in (("steps", str(steps)), ("seed", str(seed)), ("lr", lr)):
        text, found = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, count=1, flags=re.M)
        if not found and key != "lr":
            raise SystemExit(f"{path}: no `{key} = ` line to set")
    text = re.sub(r"^delayed_update = .*\n", "", text, flags=re.M)
    text = re.sub(
        r"^\[training\]$",
        f"[training]\ndelayed_update = {str(delayed).lower()}",
        text,
        count=1,
        flags=re.M,
    )
    text = re.sub(r"^(eval_every|checkpoint_every) = .*$", r"\1 = 0", text, flags=re.M)
    if eager:
        if re.search(r"^\[pool\]$", text, flags=re.M):
            raise SystemExit(f"{path}: has a [pool] section; --eager adds its own")
        text += '\n[pool]\noverlap = "eager"\n'
    return text.replace('precision = "bf16-mixed"', 'precision = "fp32"')


def final_loss(path: str, steps: int, lr: str, seed: int, rule: str) -> float:
    import torch

    torch.set_num_threads(1)  # one core per run: `--workers` runs share the machine evenly
    delayed, eager = rule != "synchronous", rule == "eager"
    job = parse_job(job_text(Path(path), steps, lr, seed, delayed, eager), Path(path).parent)
    if job.training.delayed_update != delayed:  # a `[training]` header the text edit missed
        raise SystemExit(f"{path}: could not set training.delayed_update = {delayed}")
    losses: list[float] = []

    def record(r: StepRecord) -> None:
        losses.append(r.loss)

    if eager:
        train_replicas(job, replicas=2, on_step=record)
    else:
        train_local(job, on_step=record)
    return statistics.fmean(losses[-LAST:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", default=str(ROOT / "examples" / "tiny.toml"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lrs", default="", help="comma-separated; default: the job's own")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="also delayed with the eager rule")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    path = Path(args.job).resolve()
    own = re.search(r"^lr = (\S+)", path.read_text(), flags=re.M)
    lrs = [x for x in args.lrs.split(",") if x] or ([own.group(1)] if own else [])
    if not lrs:
        raise SystemExit(f"{path}: no `lr = ` line; give --lrs")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    rules = RULES if args.eager else RULES[:2]
    runs = [(lr, seed, rule) for lr in lrs for seed in seeds for rule in rules]
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = {run: pool.submit(final_loss, str(path), args.steps, *run) for run in runs}
        losses: dict[tuple[str, int, str], float] = {}
        for run, future in futures.items():
            losses[run] = future.result()
            print(
                f"lr {run[0]} seed {run[1]} {run[2]}: {losses[run]:.4f}",
                file=sys.stderr,
                flush=True,
            )
    rows = []
    for lr in lrs:
        row: dict[str, Any] = {"lr": lr}
        for rule in rules:
            row[rule] = [losses[(lr, s, rule)] for s in seeds]
        for rule in rules[1:]:
            row[f"{rule}_vs_synchronous"] = statistics.fmean(row[rule]) / statistics.fmean(
                row["synchronous"]
            )
        rows.append(row)
    if args.json:
        print(json.dumps({"job": str(path), "steps": args.steps, "seeds": seeds, "rows": rows}))
        return
    print(
        f"{path.name}, {args.steps} steps, seeds {args.seeds}; final loss: mean of the last "
        f"{LAST} steps"
    )
    head = [f"{rule} (per seed)" for rule in rules] + [f"{r} vs synchronous" for r in rules[1:]]
    print(f"| lr | {' | '.join(head)} |")
    print("|---|" + "---|" * len(head))
    for r in rows:
        cells = [" / ".join(f"{x:.3f}" for x in r[rule]) for rule in rules]
        cells += [f"{r[f'{rule}_vs_synchronous'] - 1:+.1%}" for rule in rules[1:]]
        print(f"| {r['lr']} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
