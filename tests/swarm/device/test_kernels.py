"""A job's kernel switches on its device (`swarm.device.kernels`), decided on this CPU-only machine
through the real switch (`TorchKernels`: torch's process-wide deterministic mode, which a CPU build
sets as a CUDA one does, restored after each test): deterministic kernels exactly where a job that
audits computes on CUDA (warning, never raising, for an op that has none; uninitialized memory not
filled), and cuBLAS's repeatable workspace set in the process's own environment at a CUDA
process's start unless the operator set one. Nothing here runs CUDA."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from swarm.device.kernels import (
    CUBLAS_WORKSPACE,
    TorchKernels,
    apply_kernels,
    audits,
    deterministic_cublas,
)
from swarm.job.config import JobConfig
from tests.support.jobs import make_job

NAME, VALUE = CUBLAS_WORKSPACE


@pytest.fixture(autouse=True)
def torch_switch() -> Iterator[None]:
    """torch's deterministic switch as it was before the test (it is process-wide)."""
    utils = torch.utils.deterministic  # type: ignore[attr-defined]
    mode, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        (torch.is_deterministic_algorithms_warn_only_enabled()),
    )
    fill = utils.fill_uninitialized_memory  # type: ignore[attr-defined]
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
        utils.fill_uninitialized_memory = fill  # type: ignore[attr-defined]


def _switch() -> tuple[bool, bool, bool]:
    """torch's deterministic mode, its warn-only flag, and whether new memory is filled."""
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,  # type: ignore[attr-defined]
    )


OFF = (False, False, True)  # torch's default
ON = (True, True, False)  # deterministic, warning for an op with no such kernel, no NaN fill


def _job(tmp_path: Path, fraction: float, **overrides: dict[str, Any]) -> JobConfig:
    return make_job(tmp_path, "test", trust={"audit_fraction": fraction}, **overrides)


@pytest.mark.parametrize(
    ("device", "fraction", "switch"),
    [
        ("cuda", 0.045, ON),  # the default fraction: audited, on a GPU
        ("cuda:1", 1.0, ON),
        ("cuda", 0.0, OFF),  # no audits: nothing to repeat for, so torch's fastest kernels
        ("cpu", 0.045, OFF),  # a CPU repeats bitwise as it is
        ("mps", 0.045, OFF),
    ],
)
def test_deterministic_kernels_where_an_audited_job_computes_on_cuda(
    tmp_path: Path, device: str, fraction: float, switch: tuple[bool, bool, bool]
) -> None:
    asked = apply_kernels(_job(tmp_path, fraction), device, TorchKernels())
    assert _switch() == switch
    assert asked is (switch == ON)


def test_local_steps_audit_nothing_so_ask_for_nothing(tmp_path: Path) -> None:
    # Their replicas differ between rounds: no audit is drawn (the trainer's plane says so too).
    job = _job(tmp_path, 0.5, pool={"mode": "local", "sync_every": 2})
    assert not audits(job)
    assert apply_kernels(job, "cuda", TorchKernels()) is False and _switch() == OFF


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3", "CUDA:1"])
def test_a_cuda_process_starts_with_cublas_repeatable(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    environ: dict[str, str] = {"PATH": "/bin"}
    assert deterministic_cublas(device, environ) is True
    assert environ == {"PATH": "/bin", NAME: VALUE}
    monkeypatch.delenv(NAME, raising=False)  # the process's own environment, which torch reads
    assert deterministic_cublas(device) is True and os.environ[NAME] == VALUE


@pytest.mark.parametrize("device", ["cpu", "mps"])
def test_a_process_on_no_gpu_leaves_cublas_alone(device: str) -> None:
    environ: dict[str, str] = {}
    assert deterministic_cublas(device, environ) is False
    assert environ == {}


def test_the_operators_own_cublas_setting_is_kept() -> None:
    environ = {NAME: ":16:8"}
    assert deterministic_cublas("cuda:0", environ) is False
    assert environ == {NAME: ":16:8"}
