"""The process-wide kernel switches a job sets on the device it computes on: its float32 matmuls
(`training.tf32`: `swarm.device.facts.apply_matmul_precision`) and, on a GPU where the job audits,
deterministic kernels (issue 55, item 1: re-executions compared "within a stated tolerance with
deterministic kernels on a GPU").

Why: an audit has another replica redo a microbatch and compares the two answers within the job's
tolerance (docs/jobs.md, "Trust"). A CPU's compute repeats bitwise; a GPU's does
not always (atomics in some backward kernels; cuBLAS sharing its workspaces between streams), so
two honest answers differ by a rounding the tolerance must absorb. `torch.use_deterministic_
algorithms` narrows that gap to what differs between devices; the tolerance stays what a verdict
rests on.

`warn_only=True`, deliberately: an op with no deterministic CUDA kernel then warns and runs its
usual one, where `warn_only=False` raises in the middle of a step. Which ops lack one changes
between torch releases, and a stage server that raised would fail every microbatch of the job on
an honest volunteer's GPU: a liveness failure the job pays for in replays, to remove a rounding
gap the tolerance already covers. The price: torch's flash and memory-efficient attention keep
their nondeterministic backward under `warn_only` (it warns once; only `warn_only=False` switches
it), so a GPU's input and parameter gradients still vary run to run by rounding; the forward,
the matmuls and the index ops repeat.

cuBLAS repeats only with `CUBLAS_WORKSPACE_CONFIG` set (":4096:8"), which torch reads when it first
sizes cuBLAS's workspace: a stage server sets it as it starts, where its `--device` is CUDA
(`deterministic_cublas`), before anything touches CUDA; the job, which says whether it audits,
comes later (a swarm peer's by assignment). An operator's own setting is kept.

The switch is process-wide and stays on: a later job in the same process without audits leaves
it on (turning it off would take it from a job still served there; it costs speed, never
correctness). Behind `Kernels`, so a CPU test checks which calls a device and a job make."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Protocol

import torch

from swarm.device.facts import apply_matmul_precision
from swarm.job.config import JobConfig
from swarm.job.rule import rule_of

__all__ = [
    "CUBLAS_WORKSPACE",
    "WARN_ONLY",
    "Kernels",
    "TorchKernels",
    "apply_kernels",
    "audits",
    "deterministic_cublas",
]

CUBLAS_WORKSPACE = ("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # one of cuBLAS's repeatable settings
WARN_ONLY = True  # an op with no deterministic kernel warns, never fails a step (above: why)


class Kernels(Protocol):
    """torch's process-wide kernel switch (`TorchKernels`; the tests record the calls)."""

    def use_deterministic_algorithms(self, mode: bool, *, warn_only: bool) -> None: ...


class TorchKernels:
    """`Kernels` of the installed torch."""

    def use_deterministic_algorithms(self, mode: bool, *, warn_only: bool) -> None:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
        # Deterministic mode also fills every new uninitialized tensor (torch.empty, a cache's
        # buffers) with NaN, to expose reads of garbage: a full write of each allocation on
        # the device for nothing a re-execution compares, since no kernel here reads memory it
        # did not write. Off, so the audits' switch costs the kernels' choice only.
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]


def audits(job: JobConfig) -> bool:
    """Whether `job`'s stage compute is audited: `[trust] audit_fraction` > 0, and its rounds
    are steps' (under local steps replicas differ between rounds and no audit is drawn)."""
    return job.trust.audit_fraction > 0 and not rule_of(job).rounds


def apply_kernels(
    job: JobConfig, device: torch.device | str, kernels: Kernels | None = None
) -> bool:
    """`job`'s kernel switches on `device`, set where a stage is built: its float32 matmul
    precision, and deterministic kernels on CUDA where the job audits (`WARN_ONLY`). Whether it
    asked for deterministic kernels."""
    device = torch.device(device)
    apply_matmul_precision(job.training.tf32, device)
    if device.type != "cuda" or not audits(job):
        return False
    (kernels or TorchKernels()).use_deterministic_algorithms(True, warn_only=WARN_ONLY)
    return True


def deterministic_cublas(device: str, environ: MutableMapping[str, str] | None = None) -> bool:
    """At a process's start, before CUDA is touched: `CUBLAS_WORKSPACE_CONFIG` set to a
    repeatable setting where `device` (`--device`: cpu, cuda, cuda:N, mps) is CUDA and nobody
    set it. Whether it was set here."""
    environ = os.environ if environ is None else environ
    name, value = CUBLAS_WORKSPACE
    if device.partition(":")[0].strip().lower() != "cuda" or name in environ:
        return False
    environ[name] = value
    return True
