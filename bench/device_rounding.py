"""The contributions' audit of replicas on different kinds of device (issue 64, item 5): over
`--steps` steps of a stage of three, one replica each step (in turn) computes its microbatches'
gradients on another kind of device, the auditors in full float32 on the CPU, every contribution
audited with the job's tolerance (`swarm.job.tolerance.tolerance_of`: tf32 1e-2, bf16-mixed
2e-2). Printed: how many were accused (none expected), and, with the tolerance the audit used
before (0: its own rounding only), how many were then.

    .venv/bin/python bench/device_rounding.py [--steps 1000] [--on cpu|cuda]

`--on cpu` (the default): TF32 emulated exactly (10 bits of mantissa). `--on cuda`: the real
kernels of the GPU here, TF32 (`allow_tf32`) and bfloat16 autocast.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swarm.job.tolerance import TOLERANCE  # noqa: E402
from tests.support.audited_round import Matmul, device_audits, emulated_tf32  # noqa: E402


def _cuda_tf32(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    torch.backends.cuda.matmul.allow_tf32 = True
    return (x.cuda().T @ dy.cuda()).cpu()


def _cuda_bf16(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return (x.cuda().T @ dy.cuda()).float().cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--on", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    kinds: list[tuple[str, Matmul, float]] = [
        ("tf32, emulated", emulated_tf32, TOLERANCE["float16"])
    ]
    if args.on == "cuda":
        print(f"device: {torch.cuda.get_device_name()}")
        kinds = [
            ("tf32, the GPU's", _cuda_tf32, TOLERANCE["float16"]),
            ("bf16-mixed, the GPU's", _cuda_bf16, TOLERANCE["bfloat16"]),
        ]
    for name, matmul, tolerance in kinds:
        for said, allowed in (("the job's tolerance", tolerance), ("none (before)", 0.0)):
            start = time.perf_counter()
            accused = device_audits(args.steps, allowed, matmul)
            took = time.perf_counter() - start
            print(
                f"{name:<22} {said:<20} {len(accused):>5} of {args.steps} steps accused "
                f"({took:.1f} s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
