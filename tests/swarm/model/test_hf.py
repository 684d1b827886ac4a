"""Hugging Face interchange against the real `transformers`: a swarm model exported as a checkpoint
directory loads as `LlamaForCausalLM` / `GPT2LMHeadModel` and computes the same logits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from swarm.errors import ConfigError
from swarm.job.config import JobConfig
from swarm.model.hf import read_hf, write_hf
from swarm.model.transformer import (
    build_model,
    build_stage,
    layer_costs,
    partition,
    plain_state,
)
from tests.support.jobs import make_job

transformers = pytest.importorskip("transformers")  # a dev dependency: installed by make install

MODELS = {
    "llama": {"kind": "llama", "n_heads": 4, "n_kv_heads": 2, "rope_theta": 500000.0},
    "gpt": {"kind": "gpt"},
}


def _job(tmp_path: Path, kind: str, dtype: str = "float64") -> JobConfig:
    return make_job(tmp_path, kind, model=MODELS[kind], training={"dtype": dtype})


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_an_exported_model_loads_in_transformers_with_the_same_logits(
    tmp_path: Path, kind: str
) -> None:
    job = _job(tmp_path, kind)
    model = build_model(job)
    with torch.no_grad():  # trained a little: no parameter keeps its initial symmetry
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
            p.add_(noise.to(p.dtype), alpha=0.01)
    out = write_hf(tmp_path / "hf", model.state_dict(), job.model, None)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    expected = {"llama": "LlamaForCausalLM", "gpt": "GPT2LMHeadModel"}[kind]
    assert json.loads((out / "config.json").read_text())["architectures"] == [expected]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    assert type(hf).__name__ == expected
    ids = torch.randint(0, job.model.vocab_size, (3, job.model.seq_len))
    # transformers computes RMSNorm and the rotary angles in float32 even in a float64 model;
    # a wrong convention (interleaved rotary pairs, say) is off by ~1e-2.
    atol = 1e-6 if kind == "llama" else 1e-12
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=0, atol=atol)


def test_a_stage_reads_only_its_layers_back(tmp_path: Path) -> None:
    job = _job(tmp_path, "llama")
    state = build_model(job).state_dict()
    out = write_hf(tmp_path / "hf", state, job.model, torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ranges = partition(layer_costs(job.model), job.training.stages)
    for k, layers in enumerate(ranges):
        read = read_hf(out, job.model, layers)
        assert read.keys() == build_stage(job, k).state_dict().keys()
        for name, tensor in read.items():
            assert tensor.dtype == torch.bfloat16
            assert torch.equal(tensor, state[name].to(torch.bfloat16)), name


def test_exports_refuse_a_directory_in_use_and_a_state_of_another_model(tmp_path: Path) -> None:
    job = _job(tmp_path, "llama")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    state = build_model(job).state_dict()
    with pytest.raises(FileExistsError):
        write_hf(tmp_path / "used", state, job.model, None)
    assert [p.name for p in (tmp_path / "used").iterdir()] == ["notes.txt"]
    gpt = _job(tmp_path, "gpt")
    with pytest.raises(ConfigError, match=r"does not match model\.kind = 'gpt'"):
        write_hf(tmp_path / "other", state, gpt.model, None)
    assert not (tmp_path / "other").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # nothing left


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_subspace_model_exports_as_plain_weights_with_the_same_logits(
    tmp_path: Path, kind: str
) -> None:
    """`model.boundary_rank`: the export folds the fixed table and the projections into ordinary
    weights; `transformers` computes the constrained model's logits with no runtime of ours."""
    job = make_job(
        tmp_path,
        kind,
        model={**MODELS[kind], "n_layers": 3, "boundary_rank": 8},
        training={"dtype": "float64", "stages": 3},
    )
    model = build_model(job)
    with torch.no_grad():  # every raw weight off the subspace: only the folding puts it back
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
            p.add_(noise.to(p.dtype), alpha=0.01)
    with pytest.raises(ConfigError, match=r"model\.boundary_rank = 8"):
        write_hf(tmp_path / "raw", model.state_dict(), job.model, None)
    out = write_hf(tmp_path / "hf", *plain_state(job, model.state_dict()), None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    ids = torch.randint(0, job.model.vocab_size, (3, job.model.seq_len))
    atol = 1e-6 if kind == "llama" else 1e-12
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=0, atol=atol)
        # and the raw weights alone are another model: the folding is what makes it equal
        raw = write_hf(tmp_path / "raw2", model.state_dict(), replace_rank(job), None)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(raw, dtype=torch.float64)
        assert (theirs(ids).logits - model(ids)).abs().max() > 1e-3


def replace_rank(job: JobConfig) -> Any:
    return dataclasses.replace(job.model, boundary_rank=0)


def test_init_from_into_a_subspace_job_is_refused_by_name(tmp_path: Path) -> None:
    job = _job(tmp_path, "gpt")
    out = write_hf(tmp_path / "hf", build_model(job).state_dict(), job.model, None)
    with pytest.raises(ConfigError, match=r"model\.boundary_rank = 4 is not allowed.*init_from"):
        make_job(tmp_path, "gpt", model={"init_from": str(out), "boundary_rank": 4})
