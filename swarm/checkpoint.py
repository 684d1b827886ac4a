"""The checkpoint format: `<dir>/step-<N>/stage-<k>.pt` holds stage k's state at step N in the
stage-state format (`swarm.stage_state`); `manifest.json`, written last and atomically, marks the
checkpoint complete and records the data position (the step: data is a function of
`(seed, step, index)`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

__all__ = ["latest", "load_model", "load_stage", "save_stage", "seal"]


def _dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _atomic(path: Path, write: object) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)  # type: ignore[operator]
    tmp.replace(path)


def save_stage(root: Path, step: int, stage: int, state: dict[str, torch.Tensor]) -> None:
    path = _dir(root, step) / f"stage-{stage}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic(path, lambda tmp: torch.save(state, tmp))


def seal(root: Path, step: int, stages: int) -> None:
    """Mark step `step`'s checkpoint complete: every stage's file is written."""
    manifest = {"step": step, "stages": stages, "data_position": step}
    _atomic(_dir(root, step) / "manifest.json", lambda tmp: tmp.write_text(json.dumps(manifest)))


def latest(root: Path) -> int | None:
    """The newest complete checkpoint's step, if any."""
    steps = []
    for manifest in root.glob("step-*/manifest.json"):
        try:
            steps.append(int(json.loads(manifest.read_text())["step"]))
        except (OSError, ValueError, KeyError):
            continue  # a torn or foreign file is not a checkpoint
    return max(steps, default=None)


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
