"""`swarm generate`: sample text from a trained model in one process, to see what it learned.

The model is a Hugging Face checkpoint directory as `swarm export --format hf` and `swarm local
--format hf` write it (its `config.json` gives the architecture), or a swarm model built from a
job. Text becomes ids with the `tokenizers` file the data was prepared with, or as bytes (text
jobs, and token files prepared without a tokenizer). No key/value cache: each new token runs the
window of the last `seq_len` tokens again, which is plenty for the small models trained here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from swarm.errors import ConfigError
from swarm.job.config import JobConfig, ModelConfig, OptimizerConfig, TrainingConfig
from swarm.model.hf import WEIGHTS
from swarm.model.transformer import StageModule, build_model

__all__ = ["Codec", "from_hf", "generate", "load_hf", "text_codec"]


def from_hf(directory: str | Path) -> ModelConfig:
    """The swarm architecture a checkpoint's `config.json` describes (the inverse of
    `swarm.model.hf.hf_config`); another model family is refused by name."""
    directory = Path(directory)
    path = directory / "config.json"
    if not path.is_file():
        # A state_dict file (`swarm export` without --format hf) is the usual mistake.
        what = "is a file" if directory.is_file() else "holds no config.json"
        if not directory.exists():
            what = "does not exist"
        raise ConfigError(
            f"{directory} {what}: give a Hugging Face checkpoint directory (config.json, "
            f"{WEIGHTS}), as `swarm export JOB --format hf --out DIR` or `swarm local JOB.toml "
            "--format hf --out DIR` writes"
        )
    try:
        c = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    kind = c.get("model_type")
    try:
        if kind == "llama":
            return ModelConfig(
                kind="llama",
                vocab_size=c["vocab_size"],
                d_model=c["hidden_size"],
                n_layers=c["num_hidden_layers"],
                n_heads=c["num_attention_heads"],
                n_kv_heads=c.get("num_key_value_heads", 0) or 0,
                mlp_hidden=c["intermediate_size"],
                seq_len=c["max_position_embeddings"],
                rope_theta=float(c.get("rope_theta", 10000.0)),
                norm_eps=float(c.get("rms_norm_eps", 1e-5)),
            )
        if kind == "gpt2":
            ratio, rest = divmod(c.get("n_inner") or 4 * c["n_embd"], c["n_embd"])
            if rest:
                raise ConfigError(f"{path}: n_inner must be a multiple of n_embd")
            return ModelConfig(
                kind="gpt",
                vocab_size=c["vocab_size"],
                d_model=c["n_embd"],
                n_layers=c["n_layer"],
                n_heads=c["n_head"],
                mlp_ratio=ratio,
                seq_len=c["n_positions"],
            )
    except KeyError as e:
        raise ConfigError(f"{path} lacks {e.args[0]!r} for model_type {kind!r}") from None
    raise ConfigError(f"{path}: model_type {kind!r} is not one swarm trains (llama, gpt2)")


def load_hf(directory: str | Path, device: torch.device | str = "cpu") -> StageModule:
    """The whole model from a Hugging Face checkpoint directory, in float32 on `device`."""
    model = from_hf(directory)
    job = JobConfig(
        name="generate",
        model=replace(model, init_from=Path(directory).resolve()),
        training=TrainingConfig(stages=1, microbatch_size=1, target_batch_size=1, steps=1),
        optimizer=OptimizerConfig(kind="sgd", lr=1.0),
    )
    return build_model(job, device).eval()


@dataclass(frozen=True)
class Codec:
    """Text to ids and back."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    vocab_size: int


def text_codec(tokenizer: Path | None = None) -> Codec:
    """The `tokenizers` file's codec, or bytes (vocabulary 256) without one."""
    if tokenizer is None:
        return Codec(
            lambda text: list(text.encode()),
            lambda ids: bytes(i for i in ids if i < 256).decode(errors="replace"),
            256,
        )
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(tokenizer))
    except Exception as e:  # the library raises its own exception types
        raise ConfigError(f"{tokenizer} is not a tokenizers file that loads ({e})") from None
    return Codec(
        lambda text: list(tok.encode(text).ids),
        lambda ids: str(tok.decode(ids)),
        int(tok.get_vocab_size()),
    )


@torch.no_grad()
def generate(
    model: StageModule,
    prompt: list[int],
    *,
    seq_len: int,
    tokens: int,
    temperature: float = 0.8,
    top_k: int = 0,
    seed: int = 0,
) -> list[int]:
    """`tokens` ids sampled after `prompt` (greedy at temperature 0; among the `top_k` most
    likely when > 0), each from the last `seq_len` ids; seeded, so a run can be repeated."""
    if not prompt:
        raise ConfigError("the prompt is empty: give at least one token")
    param = next(model.parameters())
    gen = torch.Generator(device=param.device).manual_seed(seed)
    ids = torch.tensor([prompt], dtype=torch.int64, device=param.device)
    for _ in range(tokens):
        logits = model(ids[:, -seq_len:])[0, -1].float()
        if temperature <= 0:
            nxt = logits.argmax().view(1)
        else:
            if top_k > 0:
                floor = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < floor, -torch.inf)
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return [int(i) for i in ids[0, len(prompt) :]]
