"""Fine-tuning from a Hugging Face checkpoint: `[model] init_from = DIR` starts a job from the
weights `swarm export --format hf` (or anyone) wrote; each stage reads only its own tensors; the
checkpoint is pinned by its sha256 like data, and one of another architecture is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from swarm.errors import ConfigError
from swarm.job.config import load_job
from swarm.job.fingerprint import fingerprint
from swarm.model.transformer import build_model, build_stage
from tests.support.jobs import write_job
from tests.support.pretrained import LLAMA, write_finetune, write_pretrained


def test_a_job_starts_from_the_checkpoint_and_each_stage_reads_its_own_layers(
    tmp_path: Path,
) -> None:
    _, pretrained = write_pretrained(tmp_path)
    job = load_job(write_finetune(tmp_path))
    assert job.model.init_sha256 is not None  # pinned at load
    whole = build_model(job).state_dict()
    assert whole.keys() == pretrained.keys()
    for name, tensor in pretrained.items():  # float64 end to end: bitwise
        assert torch.equal(whole[name], tensor), name
    union: dict[str, torch.Tensor] = {}
    for k in range(job.training.stages):
        union.update(build_stage(job, k).state_dict())
    assert all(torch.equal(union[k], v) for k, v in whole.items())
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.copytree(tmp_path / "pretrained", moved / "pretrained")
    shutil.copy(tmp_path / "finetune.toml", moved / "finetune.toml")
    assert fingerprint(load_job(moved / "finetune.toml")) == fingerprint(job)  # contents count


def test_a_changed_or_foreign_checkpoint_is_refused(tmp_path: Path) -> None:
    checkpoint, _ = write_pretrained(tmp_path)
    job = load_job(write_finetune(tmp_path))
    text = (tmp_path / "finetune.toml").read_text()
    pinned = text.replace(
        'init_from = "pretrained"',
        f'init_from = "pretrained"\ninit_sha256 = "{job.model.init_sha256}"',
    )
    (tmp_path / "pinned.toml").write_text(pinned)
    assert fingerprint(load_job(tmp_path / "pinned.toml")) == fingerprint(job)
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b" ")  # its last byte changed
    with pytest.raises(ConfigError, match="the checkpoint changed since the job was pinned"):
        load_job(tmp_path / "pinned.toml")
    with pytest.raises(ConfigError, match="changed since the job was pinned"):
        build_stage(job, 0)  # a stage server handed the pinned spec checks the file too
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 4}))
    deeper = load_job(write_finetune(tmp_path))
    with pytest.raises(ConfigError, match="num_hidden_layers = 4 \\(the job's: 2\\)"):
        build_stage(deeper, 1)
    with pytest.raises(ConfigError, match=r"cannot read model\.safetensors"):
        load_job(write_job(tmp_path, "nowhere", model=LLAMA | {"init_from": "missing"}))
