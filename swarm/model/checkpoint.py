"""The checkpoint format: `<dir>/step-<N>/stage-<k>.pt` holds stage k's state at step N in the
stage-state format (`swarm.model.stage_state`); `manifest.json`, written last and atomically, marks
the checkpoint complete and records the data position (the step: data is a function of
`(seed, step, index)`).

Every file is written to a temporary name, fsynced, renamed, and its directory fsynced, so a
crash leaves a whole file or none. A write that fails (a full disk: `torch.save` raises
`RuntimeError` there, not `OSError`) removes its partial file and raises `CheckpointError`."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch

__all__ = [
    "CheckpointError",
    "discard",
    "latest",
    "load_model",
    "load_stage",
    "prune",
    "save_file",
    "save_stage",
    "seal",
    "sealed",
]


class CheckpointError(OSError):
    """A checkpoint file could not be written (a full or broken disk). An `OSError`, so that
    callers which skip a checkpoint on a disk error catch it whatever the writer raised."""


def _dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic(path: Path, write: Callable[[BinaryIO], object], what: str) -> None:
    def to(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            write(f)

    _atomic_path(path, to, what)


def _atomic_path(path: Path, write: Callable[[Path], object], what: str) -> None:
    """`write(tmp)` writes the file at `tmp`; it becomes `path` once it is on disk."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the bytes are on disk before the name points at them
        finally:
            os.close(fd)
        tmp.replace(path)
        _fsync_dir(path.parent)  # and the rename too
    except Exception as e:  # torch.save turns ENOSPC into RuntimeError
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise CheckpointError(f"{what}: cannot write {path} ({e})") from e


def save_stage(root: Path, step: int, stage: int, state: dict[str, torch.Tensor]) -> None:
    """Write stage `stage`'s state at `step`; a state holding a NaN or infinite value is refused
    (`CheckpointError`) before a byte is written: the last sealed checkpoint stays the one a
    rollback uses, rather than one that would poison every replica that loads it."""
    path = _dir(root, step) / f"stage-{stage}.pt"
    for name, tensor in state.items():
        if not _finite(tensor):
            raise CheckpointError(
                f"checkpoint of step {step}, stage {stage}: {name} holds NaN or infinite values;"
                f" not written"
            )
    # To a path, not a file object: torch's own writer then writes each tensor's bytes from
    # its memory (through a Python file it copies every tensor first).
    _atomic_path(
        path, lambda tmp: torch.save(state, str(tmp)), f"checkpoint of step {step}, stage {stage}"
    )


def _finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in `tensor`: its largest magnitude is finite (NaN propagates through
    the max), read in one pass without a mask the size of the tensor."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    return bool(torch.isfinite(torch.linalg.vector_norm(tensor.detach(), ord=math.inf)))


def seal(root: Path, step: int, stages: int) -> None:
    """Mark step `step`'s checkpoint complete: every stage's file is written."""
    manifest = json.dumps({"step": step, "stages": stages, "data_position": step}).encode()
    _atomic(_dir(root, step) / "manifest.json", lambda f: f.write(manifest), f"seal of step {step}")


def save_file(path: Path, obj: object, what: str) -> None:
    """`torch.save(obj)` to `path` as every checkpoint file is written (fsynced, whole or not at
    all; `CheckpointError` on failure): the scheduler's final model of a job, for one."""
    _atomic(path, lambda f: torch.save(obj, f), what)


def discard(root: Path, step: int) -> None:
    """Remove step `step`'s checkpoint, which could not be completed (never one that is sealed):
    its stage files only take room a later checkpoint needs."""
    directory = _dir(root, step)
    if not (directory / "manifest.json").exists():
        shutil.rmtree(directory, ignore_errors=True)


def prune(root: Path, keep: int) -> list[int]:
    """Delete the sealed checkpoints under `root` but the newest `keep` (at least 1: the newest
    is what a rollback and an export fall back to); returns their steps, oldest first. One not
    sealed (being written) is left alone. The manifest goes first: a directory half deleted is
    never taken for a checkpoint."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the newest sealed checkpoint), got {keep}")
    old = sealed(root)[:-keep]
    for step in old:
        (_dir(root, step) / "manifest.json").unlink(missing_ok=True)
        shutil.rmtree(_dir(root, step), ignore_errors=True)
    return old


def sealed(root: Path) -> list[int]:
    """The steps of the complete checkpoints under `root`, oldest first."""
    steps = []
    for manifest in root.glob("step-*/manifest.json"):
        try:
            steps.append(int(json.loads(manifest.read_text())["step"]))
        except (OSError, ValueError, KeyError):
            continue  # a torn or foreign file is not a checkpoint
    return sorted(steps)


def latest(root: Path) -> int | None:
    """The newest complete checkpoint's step, if any."""
    return max(sealed(root), default=None)


def load_stage(root: Path, step: int, stage: int) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = torch.load(
        _dir(root, step) / f"stage-{stage}.pt", weights_only=True
    )
    return state


def load_model(root: Path, step: int) -> dict[str, torch.Tensor]:
    """The whole model's parameters from a complete checkpoint (for export)."""
    stages = json.loads((_dir(root, step) / "manifest.json").read_text())["stages"]
    model: dict[str, torch.Tensor] = {}
    for k in range(stages):
        for name, value in load_stage(root, step, k).items():
            if name.startswith("param/"):
                model[name.removeprefix("param/")] = value
    return model
