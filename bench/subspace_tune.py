"""The subspace boundary's settings by equal-step validation loss (issue 52), deterministic and in
one process: bench/boundary.py's workload trained for the same steps with each setting (rank,
codec, `[model]` keys such as `boundary_table`), its loss against the plain model's (no subspace,
no codec) and its bytes per token per boundary each way. What bench/boundary.py's table needs
from the loss columns, without namespaces or root, and fast enough to sweep.

    .venv/bin/python bench/subspace_tune.py [--rows "r96+hadamard3, r48+hadamard3; table=0.05"]
        [--workload d320|small] [--steps 480] [--eval-every 0] [--eval-microbatches 4]
        [--workers 2] [--base-loss LOSS] [--json]

A row is `full` or `r<rank>`, optionally `+<codec>` (bf16, int8_blockwise, hadamard3: both
directions), optionally `; key=value ...`: more `[model]` keys (`table=0.05` is
`boundary_table = 0.05`). The plain row (`full`) runs first and every penalty is against it,
unless `--base-loss` gives its loss from an earlier run of the same flags.

Each row builds the job's 4 stages as stage servers do (`build_stage`) and chains them in one
process; at every boundary the forward tensor and, backward, its gradient go through the row's
codec exactly as the wire encodes and decodes them (`swarm.wire.codec`): a row computes what the
swarm does on the push plane with `[compression] wire = codec` (without a codec, `swarm local`'s
model, up to float32 rounding). The step is `swarm local`'s (`train_local`: the same microbatches,
per-stage clipping, optimizer). `--eval-every` adds evaluations along the way (each printed to
stderr as it comes, so a long sweep's partial curves can be read). Bytes per token are the
encoded payload's (the token ids, 1 byte per token per hop for bytes, travel beside and are not
counted, as the stage servers' `swarm_stage_boundary_bytes_sent_total` does not count them).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import boundary  # noqa: E402  (puts the repository root on sys.path too)

from swarm.job.config import JobConfig, parse_job  # noqa: E402
from swarm.model import reference  # noqa: E402
from swarm.model.data import make_data  # noqa: E402
from swarm.model.transformer import build_stage  # noqa: E402
from swarm.wire.codec import codec_from_name, decode, encode  # noqa: E402

_KEYS = {"table": "boundary_table"}  # short row keys -> [model] keys


def parse_row(text: str) -> tuple[str, int, str, dict[str, str]]:
    """`r64+hadamard3; table=0` -> (its name, rank, codec, more [model] keys)."""
    head, _, rest = text.partition(";")
    kind, _, codec = head.strip().partition("+")
    if kind != "full" and not (kind.startswith("r") and kind[1:].isdigit()):
        raise argparse.ArgumentTypeError(f"row {text!r}: full or r<rank>, then +codec")
    codec_from_name(codec or "none")  # refused by name here, not after an hour of training
    keys = {}
    for item in rest.split():
        key, _, value = item.partition("=")
        keys[_KEYS.get(key, key)] = value
    return text.strip(), 0 if kind == "full" else int(kind[1:]), codec or "none", keys


def job_of(args: argparse.Namespace, rank: int, keys: dict[str, str]) -> JobConfig:
    more = "; ".join(f"{k} = {v}" for k, v in keys.items())
    ns = argparse.Namespace(workload=args.workload, rank=rank, subspace_keys=more)
    row = boundary.Row("subspace" if rank else "full", bool(rank), "none")
    text = boundary.job_text(ns, row, args.steps, args.eval_every or args.steps)
    text = text.replace("eval_microbatches = 4", f"eval_microbatches = {args.eval_microbatches}")
    return parse_job(text, boundary.ROOT, "subspace-tune")


class _Wire(torch.autograd.Function):
    """A boundary crossing: the tensor encoded and decoded by the codec forward, its gradient
    the same way backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, codec: int, block: int) -> torch.Tensor:
        ctx.codec, ctx.block = codec, block
        return _through(x, codec, block)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _through(g, ctx.codec, ctx.block), None, None


def _through(t: torch.Tensor, codec: int, block: int) -> torch.Tensor:
    msg = encode(t.detach().contiguous(), "boundary", codec, block)
    return decode(msg).to(t.dtype).clone()


class Chained(nn.Module):
    """The job's stages chained in one process, each boundary through the codec both ways; its
    `layers` are the stages' (so `train_local` groups the parameters by stage as it does)."""

    def __init__(self, job: JobConfig, codec: str) -> None:
        super().__init__()
        self.stages = [build_stage(job, k) for k in range(job.training.stages)]
        for k, stage in enumerate(self.stages):
            self.add_module(f"stage{k}", stage)
        self.layers = {i: layer for s in self.stages for i, layer in s.layers.items()}
        self.codec, self.block = codec_from_name(codec), job.compression.block_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = ids
        for k, stage in enumerate(self.stages):
            if k:
                x = _Wire.apply(x, self.codec, self.block)
            x = stage(x, ids) if stage.needs_tokens else stage(x)
        return x

    def bytes_per_token(self, ids: torch.Tensor) -> float:
        """Payload bytes per token of the first boundary's forward tensor (its gradient has the
        same shape and codec, so the same bytes)."""
        with torch.no_grad():
            out = self.stages[0](ids)
        return len(encode(out, "boundary", self.codec, self.block).data) / ids.numel()


def run(args: argparse.Namespace, row: str) -> dict[str, Any]:
    name, rank, codec, keys = parse_row(row)
    torch.set_num_threads(1)
    job = job_of(args, rank, keys)
    built: list[Chained] = []

    def chained(job: JobConfig, device: Any) -> Chained:
        built.append(Chained(job, codec))
        return built[0]

    evals: list[tuple[int, float]] = []

    def on_step(r: Any) -> None:
        if r.val_loss is not None:  # as it comes: a long sweep's partial curves are readable
            evals.append((r.step, r.val_loss))
            print(
                json.dumps({"row": name, "step": r.step, "val_loss": r.val_loss}),
                file=sys.stderr,
                flush=True,
            )

    original = reference.build_model
    reference.build_model = chained  # type: ignore[assignment]
    try:
        reference.train_local(job, on_step=on_step)
    finally:
        reference.build_model = original
    ids = make_data(job).microbatch(0, 0)[0]
    return {
        "row": name,
        "bytes_per_token": built[0].bytes_per_token(ids),
        "val_loss": evals[-1][1],
        "evals": evals,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="r96+hadamard3, r48+hadamard3")
    parser.add_argument("--workload", choices=sorted(boundary.WORKLOADS), default="d320")
    parser.add_argument("--steps", type=int, default=480)
    parser.add_argument("--eval-microbatches", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=0, help="0: at the end only")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--base-loss", type=float, help="the plain row's loss, known: not rerun")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [r.strip() for r in args.rows.split(",") if r.strip() and r.strip() != "full"]
    rows = rows if args.base_loss is not None else ["full", *rows]
    for row in rows:
        parse_row(row)
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(run, [args] * len(rows), rows))
    bf16 = 2 * boundary.WORKLOADS[args.workload]["d_model"]
    base = results[0]["val_loss"] if args.base_loss is None else args.base_loss
    for r in results:
        r["fewer_than_bf16"] = bf16 / r["bytes_per_token"]
        r["penalty"] = r["val_loss"] / base - 1
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    val = f"validation on {args.eval_microbatches} microbatches"
    print(f"workload {args.workload}, {args.steps} steps, {val}")
    print(
        "| row | B/token each way | x fewer than bf16 | val loss | penalty |\n|---|---|---|---|---|"
    )
    for r in results:
        print(
            f"| {r['row']} | {r['bytes_per_token']:.1f} | {r['fewer_than_bf16']:.1f} | "
            f"{r['val_loss']:.4f} | {100 * r['penalty']:+.2f}% |"
        )
    return 0 if all(math.isfinite(r["val_loss"]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
