"""A pretrained checkpoint and a job that fine-tunes from it (`[model] init_from`): a llama trained
a few steps by `swarm local`, exported as a Hugging Face checkpoint beside the job file."""

from __future__ import annotations

from pathlib import Path

import torch

from swarm.job.config import load_job
from swarm.model.hf import write_hf
from tests.support.equality import local_state
from tests.support.jobs import write_job

__all__ = ["LLAMA", "write_finetune", "write_pretrained"]

LLAMA = {"kind": "llama", "n_heads": 4, "n_kv_heads": 2}


def write_pretrained(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A llama trained 4 steps by `swarm local`, exported as a Hugging Face checkpoint."""
    base = load_job(write_job(tmp_path, "base", model=LLAMA, training={"steps": 4}))
    state = local_state(base)
    write_hf(tmp_path / "pretrained", state, base.model, None)
    return tmp_path / "pretrained", state


def write_finetune(tmp_path: Path, **training: object) -> Path:
    """A job fine-tuning from `write_pretrained`'s checkpoint on 3 stages, with `training` keys."""
    model = LLAMA | {"init_from": "pretrained"}  # relative to the job file
    settings = {"steps": 3, "seed": 5, "stages": 3, **training}
    return write_job(tmp_path, "finetune", model=model, training=settings)
