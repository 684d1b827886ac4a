"""`swarm generate`: text sampled from an exported model in one process. A model trained by
`swarm local` on a text that repeats one sentence continues a prompt with that sentence."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from swarm.cli import main
from swarm.errors import ConfigError
from swarm.job.config import ModelConfig
from swarm.model.generate import from_hf, generate, load_hf, text_codec
from swarm.model.hf import hf_config
from tests.support.jobs import write_job

SENTENCE = "the quick brown fox jumps over the lazy dog. "
SEQ = 16  # the model's context, in characters: past "over the " to tell "lazy" from "quick"


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(kind="llama", n_heads=4, n_kv_heads=2, mlp_hidden=96, rope_theta=5e5),
        ModelConfig(kind="gpt", d_model=32, n_layers=2, n_heads=2, mlp_ratio=3, seq_len=16),
    ],
    ids=["llama", "gpt"],
)
def test_a_checkpoints_config_gives_back_the_architecture(tmp_path: Path, cfg: ModelConfig) -> None:
    (tmp_path / "config.json").write_text(json.dumps(hf_config(cfg)))
    assert from_hf(tmp_path) == replace(
        cfg, mlp_hidden=cfg.swiglu_hidden if cfg.kind == "llama" else 0
    )


def test_a_model_that_learned_a_sentence_continues_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 60 steps of 2 microbatches of 16 characters: an eighth of the 120 steps of 4 microbatches
    # of 32 it trained on before, and the sentence still comes back whole (from 40 steps on;
    # at 30 the model loops over its first half)
    (tmp_path / "text.txt").write_text(SENTENCE * 200)
    job = write_job(
        tmp_path,
        model={"kind": "llama", "vocab_size": 256, "d_model": 64, "n_heads": 4, "seq_len": SEQ},
        data={"kind": "text", "path": "text.txt"},
        training={"stages": 1, "steps": 60, "target_batch_size": 8, "dtype": "float32"},
        optimizer={"lr": 3e-3},
    )
    assert main(["local", str(job), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    capsys.readouterr()
    prompt = "the quick brown"
    argv = ["generate", str(tmp_path / "hf"), "--prompt", prompt, "--temperature", "0"]
    assert main([*argv, "--tokens", "60"]) == 0
    out = capsys.readouterr().out.rstrip("\n")
    assert out.startswith(prompt) and len(out) == len(prompt) + 60
    assert SENTENCE.strip() in out, out  # a whole sentence, after the prompt's own
    # Seeded: the same command samples the same text; another seed (temperature 1) may differ.
    assert main([*argv[:-2], "--seed", "3", "--tokens", "30"]) == 0
    first = capsys.readouterr().out
    assert main([*argv[:-2], "--seed", "3", "--tokens", "30"]) == 0
    assert capsys.readouterr().out == first
    model = load_hf(tmp_path / "hf")
    codec = text_codec()
    ids = generate(model, codec.encode(prompt), seq_len=SEQ, tokens=5, temperature=0.0)
    assert codec.decode(ids) == " fox "


def test_bad_models_and_prompts_are_refused_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    assert "model_type 'bert' is not one swarm trains" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "none"), "--prompt", "x"]) == 2
    assert "none does not exist: give a Hugging Face checkpoint" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps(hf_config(ModelConfig(vocab_size=128))))
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    assert "the model knows 128 tokens, the tokenizer makes 256" in capsys.readouterr().err
    (tmp_path / "tok.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a tokenizers file"):
        text_codec(tmp_path / "tok.json")
