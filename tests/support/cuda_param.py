"""`CPU_AND_CUDA`: a test's `device` parameter, the CPU always and `cuda:0` where torch sees one
(skipped with "needs CUDA" elsewhere: the device check, bench/gpu_cuda_tests.py, runs those)."""

from __future__ import annotations

import pytest
import torch

__all__ = ["CPU_AND_CUDA"]

CPU_AND_CUDA = [
    "cpu",
    pytest.param(
        "cuda:0", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ),
]
