"""Equal to `swarm local`: the parameters a job ends with, compared with the reference training
(`swarm.model.reference.train_local`, what `swarm local` runs) within a per-test tolerance."""

from __future__ import annotations

from pathlib import Path

import torch

from swarm.job.config import JobConfig, load_job
from swarm.model.reference import train_local

__all__ = ["assert_equal_to_local", "assert_states_within", "local_state"]

DEFAULT_TOL = 1e-9
"""float64 training, only the order of float additions differs."""


def local_state(job: JobConfig | Path) -> dict[str, torch.Tensor]:
    """`swarm local`'s final parameters for `job` (a config, or a job file)."""
    config = job if isinstance(job, JobConfig) else load_job(job)
    return train_local(config).state_dict()


def assert_states_within(
    state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tol: float
) -> None:
    """Same names, and every tensor within `tol` (max absolute difference) of `expected`'s."""
    assert state.keys() == expected.keys()
    for name, want in expected.items():
        diff = (state[name] - want).abs().max().item()
        assert diff <= tol, f"{name}: {diff}"


def assert_equal_to_local(
    job: JobConfig | Path, state: dict[str, torch.Tensor], tol: float = DEFAULT_TOL
) -> None:
    """`state` equals `swarm local`'s parameters for `job` within `tol`."""
    assert_states_within(state, local_state(job), tol)
