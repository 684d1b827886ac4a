"""A job's kernel switches on its device (`swarm.device.kernels`), decided on this CPU-only machine
behind the `Kernels` seam: deterministic kernels exactly where a job that audits computes on CUDA
(warning, never raising, for an op that has none), and cuBLAS's repeatable workspace set at a CUDA
process's start unless the operator set one. Nothing here runs CUDA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from swarm.device.kernels import CUBLAS_WORKSPACE, apply_kernels, audits, deterministic_cublas
from swarm.job.config import JobConfig
from tests.support.jobs import make_job

NAME, VALUE = CUBLAS_WORKSPACE


class Recorded:
    """The calls `apply_kernels` made of torch's switch."""

    def __init__(self) -> None:
        self.calls: list[tuple[bool, bool]] = []

    def use_deterministic_algorithms(self, mode: bool, *, warn_only: bool) -> None:
        self.calls.append((mode, warn_only))


def _job(tmp_path: Path, fraction: float, **overrides: dict[str, Any]) -> JobConfig:
    return make_job(tmp_path, "test", trust={"audit_fraction": fraction}, **overrides)


@pytest.mark.parametrize(
    ("device", "fraction", "calls"),
    [
        ("cuda", 0.045, [(True, True)]),  # the default fraction: audited, on a GPU
        ("cuda:1", 1.0, [(True, True)]),
        ("cuda", 0.0, []),  # no audits: nothing to repeat for, so torch's fastest kernels
        ("cpu", 0.045, []),  # a CPU repeats bitwise as it is
        ("mps", 0.045, []),
    ],
)
def test_deterministic_kernels_where_an_audited_job_computes_on_cuda(
    tmp_path: Path, device: str, fraction: float, calls: list[tuple[bool, bool]]
) -> None:
    kernels = Recorded()
    asked = apply_kernels(_job(tmp_path, fraction), device, kernels)
    assert kernels.calls == calls
    assert asked is bool(calls)


def test_local_steps_audit_nothing_so_ask_for_nothing(tmp_path: Path) -> None:
    # Their replicas differ between rounds: no audit is drawn (the trainer's plane says so too).
    job = _job(tmp_path, 0.5, pool={"mode": "local", "sync_every": 2})
    kernels = Recorded()
    assert not audits(job)
    assert apply_kernels(job, "cuda", kernels) is False and kernels.calls == []


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3", "CUDA:1"])
def test_a_cuda_process_starts_with_cublas_repeatable(device: str) -> None:
    environ: dict[str, str] = {"PATH": "/bin"}
    assert deterministic_cublas(device, environ) is True
    assert environ == {"PATH": "/bin", NAME: VALUE}


@pytest.mark.parametrize("device", ["cpu", "mps"])
def test_a_process_on_no_gpu_leaves_cublas_alone(device: str) -> None:
    environ: dict[str, str] = {}
    assert deterministic_cublas(device, environ) is False
    assert environ == {}


def test_the_operators_own_cublas_setting_is_kept() -> None:
    environ = {NAME: ":16:8"}
    assert deterministic_cublas("cuda:0", environ) is False
    assert environ == {NAME: ":16:8"}
