"""How far apart two honest answers of a job's stage compute may be (issue 55): the rounding of
another device's kernels in the arithmetic the job computes in. The trainer's audits hold
re-executed answers to it (`client.audit.audits`), the coordinator two auditors' digests of
a gradient (`scheduler.coordinator.trust.digest_disputes`): within it, a disagreement convicts no
one.
"""

from __future__ import annotations

from swarm.job.config import JobConfig

__all__ = ["LOSSY", "TOLERANCE", "tolerance_of"]

# Relative to the largest element of the honest answer: the rounding of another device's kernels
# (a GPU's, a CPU with other vector units), far below any error worth making. A liar whose error
# stays under it moves the model less than the dtype's own rounding across machines does.
TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 2e-2, "float16": 1e-2}
LOSSY = 2e-2  # at least, with a lossy activation codec: one may round an ulp apart


def tolerance_of(job: JobConfig) -> float:
    """The relative gap an audit of `job` accepts between two honest answers: that of the
    arithmetic its stages compute in, not only of its parameters' dtype. Under
    `training.precision = "bf16-mixed"` they compute in bfloat16 whatever the wire; with
    `training.tf32` a GPU's float32 matmuls keep 10 bits of mantissa, as float16's (a CPU's
    keep 23): held to float32's 1e-4, an honest replica on another device, or on a CPU beside
    GPUs, would be convicted by two that share its neighbour's kernels."""
    tolerance = TOLERANCE[job.training.dtype]
    if job.training.precision == "bf16-mixed":
        tolerance = max(tolerance, TOLERANCE["bfloat16"])
    if job.training.tf32 and job.training.dtype == "float32":
        tolerance = max(tolerance, TOLERANCE["float16"])
    if (job.compression.forward, job.compression.backward) != ("none", "none"):
        tolerance = max(tolerance, LOSSY)
    return tolerance
