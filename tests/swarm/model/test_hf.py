"""Hugging Face interchange against the real `transformers`: a swarm model exported as a checkpoint
directory loads as `LlamaForCausalLM` / `GPT2LMHeadModel` and computes the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from swarm.errors import ConfigError
from swarm.job.config import JobConfig
from swarm.model.hf import read_hf, write_hf
from swarm.model.transformer import build_model, build_stage, layer_costs, partition
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
