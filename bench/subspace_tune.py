"""The boundary's equal-step loss (issue 52), deterministic and in one process: bench/boundary.py's
workload trained for the same steps with each boundary setting, its validation loss against the
plain model's (no subspace, no codec), and its bytes per token per boundary each way.

    .venv/bin/python bench/subspace_tune.py [--rows "r64+hadamard3, r96+bf16; table=0, ..."]
        [--workload d320|small] [--steps 480] [--eval-microbatches 4] [--workers 2] [--json]

A row is `full` or `r<rank>`, optionally `+<codec>` (bf16, int8_blockwise, hadamard3: both
directions), optionally `; key=value ...` (more `[model]` keys, e.g. `table=0` for
`boundary_table = 0`). The plain row (`full`) always runs first: every penalty is against it.

Each row builds the job's 4 stages (`build_stage`, as the stage servers do) and chains them in one
process; at each boundary the forward tensor and, backward, its gradient go through the row's codec
exactly as the wire encodes and decodes them (`swarm.wire.codec`), so a row's loss is the swarm's
on the push plane without the network (a row without a codec is `swarm local`'s model up to
float32 rounding). The step is `swarm local`'s (`train_local`: the same microbatches, clipping per
stage, optimizer). Bytes per token are the encoded payload's, measured on the first microbatch
(the token ids, 1 byte per token per hop, travel beside and are not counted, as the stage servers'
`swarm_stage_boundary_bytes_sent_total` does not count them). No namespaces, no root: the loss
columns of bench/boundary.py's table, not its times.
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
    text = boundary.job_text(ns, row, args.steps, args.steps)
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
        self.stages = nn.ModuleList(
            build_stage(job, k) for k in range(job.training.stages)
        )
        self.layers = {k: v for s in self.stages for k, v in s.layers.items()}
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
    original = reference.build_model
    reference.build_model = chained  # type: ignore[assignment]
    try:
        reference.train_local(
            job, on_step=lambda r: evals.append((r.step, r.val_loss)) if r.val_loss else None
        )
    finally:
        reference.build_model = original
    ids = reference.make_data(job).microbatch(0, 0)[0]
    return {
        "row": name,
        "bytes_per_token": built[0].bytes_per_token(ids),
        "val_loss": evals[-1][1],
        "evals": evals,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="r32; r32+hadamard3; r64+hadamard3; r96+hadamard3")
    parser.add_argument("--workload", choices=sorted(boundary.WORKLOADS), default="d320")
    parser.add_argument("--steps", type=int, default=480)
    parser.add_argument("--eval-microbatches", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = ["full", *(r.strip() for r in args.rows.split(",") if r.strip() and r.strip() != "full")]
    for row in rows:
        parse_row(row)
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(run, [args] * len(rows), rows))
    bf16 = 2 * boundary.WORKLOADS[args.workload]["d_model"]
    base = results[0]["val_loss"]
    for r in results:
        r["fewer_than_bf16"] = bf16 / r["bytes_per_token"]
        r["penalty"] = r["val_loss"] / base - 1
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"workload {args.workload}, {args.steps} steps, validation on {args.eval_microbatches} microbatches")
    print("| row | B/token each way | x fewer than bf16 | val loss | penalty |\n|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['row']} | {r['bytes_per_token']:.1f} | {r['fewer_than_bf16']:.1f} | "
            f"{r['val_loss']:.4f} | {100 * r['penalty']:+.2f}% |"
        )
    return 0 if all(math.isfinite(r["val_loss"]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
