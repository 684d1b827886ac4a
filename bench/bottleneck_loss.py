"""What a small boundary costs in equal-step validation loss, in one process, deterministically:
the learned bottleneck (`[model] boundary_bottleneck`) against the subspace boundary
(`[model] boundary_rank`) at the same bytes per token, each with a codec on top (issue 52).

    .venv/bin/python bench/bottleneck_loss.py [--rows full,rank64,bottleneck20+int8_blockwise,...]
        [--steps 480] [--eval-every 480] [--workload d320|small] [--threads 2] [--json]

The workload is bench/boundary.py's (bench/time_to_loss.py's d_model-320 byte-level GPT on the
bundled text, 4 stages of one block, 32 samples of 32 tokens per step, AdamW lr 1e-3, float32).
The stages are built as stage servers build them (`build_stage`) and chained in this process;
at every boundary the outputs, and backward their gradients, go through the row's codec as the
wire sends them (`swarm.wire.codec` encode then decode), so a row computes what the swarm
computes with `[compression] wire = codec`, without the network and its timing. Without a
codec the chain is `swarm local`'s model. Every row starts from the job's seed and sees the
same microbatches: the only difference between rows is the boundary.

Rows: `full` (the baseline: d_model float32 values), `rank<r>` (the subspace boundary at rank
r), `bottleneck<r>` (the learned bottleneck at width r), each optionally `+<codec>` (bf16,
int8_blockwise, hadamard3). Printed per row: the payload bytes per token each way per boundary
(the token ids a subspace boundary sends beside, 1 B per token forward for bytes, not counted),
how many times fewer than a bf16 boundary (2 x d_model), the validation loss at the last step and
against the full row's. The trajectories are chaotic: read differences of a percent or two as
noise (docs/compression.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import boundary  # noqa: E402  (puts the repository root on sys.path too)

from swarm.job.config import JobConfig, parse_job  # noqa: E402
from swarm.model.data import make_data, make_val_data  # noqa: E402
from swarm.model.optim import build_optimizer, clip_scale, grad_sq_norm, update  # noqa: E402
from swarm.model.reference import evaluate  # noqa: E402
from swarm.model.transformer import StageModule, build_stage, loss_sum  # noqa: E402
from swarm.wire.codec import codec_from_name, decode, encode  # noqa: E402

STAGES = boundary.STAGES


def job_of(workload: str, row: str, steps: int, eval_every: int) -> JobConfig:
    """bench/boundary.py's job for `row` (its wire codec unused: `Chain` applies the row's)."""
    kind, _, _ = row.partition("+")
    rank = int(kind[4:]) if kind.startswith("rank") else 0
    width = int(kind[10:]) if kind.startswith("bottleneck") else 0
    if kind != "full" and not (rank or width):
        raise SystemExit(f"row {row!r}: use full, rank<r> or bottleneck<r>, optionally +codec")
    args = argparse.Namespace(workload=workload, rank=rank, subspace_keys="", bottleneck=width)
    shape = boundary.Row(kind, bool(rank), "none", bool(width))
    return parse_job(boundary.job_text(args, shape, steps, eval_every), BENCH.parent)


class Wire(torch.autograd.Function):
    """A boundary tensor as the far side decodes it, both ways; counts the payload bytes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, codec: int, count: list[int] | None) -> torch.Tensor:
        ctx.codec, ctx.count = codec, count
        msg = encode(x, "x", codec)
        if count is not None:
            count[0] += len(msg.data)
        return decode(msg).clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        msg = encode(g.contiguous(), "g", ctx.codec)
        if ctx.count is not None:
            ctx.count[1] += len(msg.data)
        return decode(msg).clone(), None, None


class Chain(torch.nn.Module):
    """The stages chained as the swarm chains them, each boundary through `codec` (none: as is)."""

    def __init__(self, job: JobConfig, codec: str) -> None:
        super().__init__()
        self.stages = torch.nn.ModuleList(build_stage(job, k) for k in range(STAGES))
        self.codec = codec_from_name(codec)
        self.count = [0, 0]  # payload bytes sent forward, backward (all boundaries)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = ids
        for k, stage in enumerate(self.stages):
            assert isinstance(stage, StageModule)
            if k:
                # Counted in a training step only (an evaluation has no backward).
                count = self.count if torch.is_grad_enabled() else None
                x = Wire.apply(x, self.codec, count)
            x = stage(x, ids) if stage.needs_tokens else stage(x)
        return x


def run(workload: str, row: str, steps: int, eval_every: int) -> dict[str, Any]:
    job = job_of(workload, row, steps, eval_every)
    chain = Chain(job, row.partition("+")[2] or "none")
    params = [list(s.parameters()) for s in chain.stages]
    optimizer = build_optimizer([p for stage in params for p in stage], job.optimizer)
    data, val = make_data(job), make_val_data(job)
    curve: list[tuple[int, float]] = []
    tokens, start = 0, time.perf_counter()
    for step in range(steps):
        if step and step % eval_every == 0:
            curve.append((step, evaluate(job, chain, val, "cpu")))  # type: ignore[arg-type]
        samples = 0
        for index in range(job.training.microbatches_per_step):
            inputs, targets = data.microbatch(step, index)
            loss_sum(chain(inputs), targets).backward()
            samples += int(inputs.shape[0])
            tokens += inputs.numel()
        for stage in params:
            for p in stage:
                assert p.grad is not None
                p.grad.div_(samples)
        norms = [grad_sq_norm(p.grad for p in stage if p.grad is not None) for stage in params]
        update(optimizer, job, step, clip_scale(norms, job.training.grad_clip))
    curve.append((steps, evaluate(job, chain, val, "cpu")))  # type: ignore[arg-type]
    cuts = STAGES - 1
    fwd, bwd = (chain.count[i] / tokens / cuts for i in (0, 1))
    return dict(
        row=row,
        fwd=fwd,
        bwd=bwd,
        fewer=2 * job.model.d_model / max(fwd, bwd),
        val=curve[-1][1],
        curve=curve,
        seconds=time.perf_counter() - start,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="full,rank64,bottleneck20+bf16,rank20+bf16")
    parser.add_argument("--steps", type=int, default=480)
    parser.add_argument("--eval-every", type=int, default=480)
    parser.add_argument("--workload", choices=sorted(boundary.WORKLOADS), default="d320")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    results = []
    for row in rows:
        results.append(run(args.workload, row, args.steps, args.eval_every))
        r = results[-1]
        print(f"# {json.dumps(r)}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(results, indent=1))
        return
    base = next((r["val"] for r in results if r["row"] == "full"), float("nan"))
    print(f"equal-step validation loss at step {args.steps} ({args.workload})")
    print("| row | B/token fwd | B/token bwd | x fewer than bf16 | val loss | vs full |")
    print("|---|---|---|---|---|---|")
    for r in results:
        change = 100 * (r["val"] / base - 1)
        print(
            f"| {r['row']} | {r['fwd']:.1f} | {r['bwd']:.1f} | {r['fewer']:.1f} "
            f"| {r['val']:.4f} | {change:+.2f}% |"
        )


if __name__ == "__main__":
    main()
