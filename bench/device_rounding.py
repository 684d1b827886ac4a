"""The contributions' audit of replicas on different kinds of device (issue 64, item 5): over
`--steps` steps of a stage of three, one replica each step (in turn) computes its microbatches'
gradients with TF32 matmuls (emulated exactly on the CPU: 10 bits of mantissa, as a GPU's
`allow_tf32`), the auditors in full float32, every contribution audited with the job's tolerance
(`swarm.job.tolerance.tolerance_of`, tf32: 1e-2). Printed: how many were accused (none expected),
and, with the tolerance the audit used before (0: its own rounding only), how many were then.

    .venv/bin/python bench/device_rounding.py [--steps 1000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swarm.job.tolerance import TOLERANCE  # noqa: E402
from tests.support.audited_round import device_audits  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    for name, tolerance in (("the job's tolerance", TOLERANCE["float16"]), ("none (before)", 0.0)):
        start = time.perf_counter()
        accused = device_audits(args.steps, tolerance)
        took = time.perf_counter() - start
        print(f"{name:<20} {len(accused):>5} of {args.steps} steps accused ({took:.1f} s)")


if __name__ == "__main__":
    main()
