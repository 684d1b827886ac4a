"""Hugging Face interchange: a swarm model's state_dict as a `transformers` checkpoint directory
(`model.safetensors` and `config.json`) that `LlamaForCausalLM` or `GPT2LMHeadModel` loads, and
back.

A swarm state_dict names parameters `layers.<i>.<name>` with global layer indices (0 the
embedding, 1..n_layers the blocks, n_layers + 1 the head); `transformers` names them per module
of its own classes. Both map one to one: the rotary convention of `llama` is Hugging Face's
(rotate-half), so no weight is permuted; GPT-2's `Conv1D` stores linear weights transposed.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from swarm.errors import ConfigError
from swarm.job.config import ModelConfig

__all__ = ["WEIGHTS", "check_hf_config", "hf_config", "read_hf", "to_hf", "write_hf"]

WEIGHTS, CONFIG = "model.safetensors", "config.json"


def _names(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    """(swarm name, Hugging Face name, stored transposed) for every parameter of the model."""
    last = cfg.n_layers + 1
    if cfg.kind == "llama":
        block = [
            ("attn_norm.weight", "input_layernorm.weight"),
            ("q.weight", "self_attn.q_proj.weight"),
            ("k.weight", "self_attn.k_proj.weight"),
            ("v.weight", "self_attn.v_proj.weight"),
            ("o.weight", "self_attn.o_proj.weight"),
            ("mlp_norm.weight", "post_attention_layernorm.weight"),
            ("gate.weight", "mlp.gate_proj.weight"),
            ("up.weight", "mlp.up_proj.weight"),
            ("down.weight", "mlp.down_proj.weight"),
        ]
        names = [("layers.0.tok.weight", "model.embed_tokens.weight", False)]
        for i in range(1, last):
            prefix = f"model.layers.{i - 1}."
            names += [(f"layers.{i}.{a}", prefix + b, False) for a, b in block]
        return [
            *names,
            (f"layers.{last}.norm.weight", "model.norm.weight", False),
            (f"layers.{last}.lm_head.weight", "lm_head.weight", False),
        ]
    block_gpt = [  # (swarm, GPT-2, a Conv1D weight: transposed)
        ("ln1.weight", "ln_1.weight", False),
        ("ln1.bias", "ln_1.bias", False),
        ("qkv.weight", "attn.c_attn.weight", True),
        ("qkv.bias", "attn.c_attn.bias", False),
        ("proj.weight", "attn.c_proj.weight", True),
        ("proj.bias", "attn.c_proj.bias", False),
        ("ln2.weight", "ln_2.weight", False),
        ("ln2.bias", "ln_2.bias", False),
        ("fc.weight", "mlp.c_fc.weight", True),
        ("fc.bias", "mlp.c_fc.bias", False),
        ("out.weight", "mlp.c_proj.weight", True),
        ("out.bias", "mlp.c_proj.bias", False),
    ]
    names = [
        ("layers.0.tok.weight", "transformer.wte.weight", False),
        ("layers.0.pos.weight", "transformer.wpe.weight", False),
    ]
    for i in range(1, last):
        names += [(f"layers.{i}.{a}", f"transformer.h.{i - 1}.{b}", t) for a, b, t in block_gpt]
    return [
        *names,
        (f"layers.{last}.ln_f.weight", "transformer.ln_f.weight", False),
        (f"layers.{last}.ln_f.bias", "transformer.ln_f.bias", False),
        (f"layers.{last}.lm_head.weight", "lm_head.weight", False),
    ]


def hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, object]:
    """The `config.json` of `cfg`'s architecture, as `transformers` reads it."""
    dtype_name = str(dtype).removeprefix("torch.")
    if cfg.kind == "llama":
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.swiglu_hidden,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.d_model // cfg.n_heads,
            "max_position_embeddings": cfg.seq_len,
            "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "bos_token_id": None,  # the tokenizer's business, not the model's
            "eos_token_id": None,
            "torch_dtype": dtype_name,
        }
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.mlp_ratio * cfg.d_model,
        "n_positions": cfg.seq_len,
        "activation_function": "gelu",  # exact GELU, as `torch.nn.functional.gelu`
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": dtype_name,
    }


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """`state` (the whole model, swarm names) under Hugging Face's names, contiguous."""
    names = _names(cfg)
    missing = sorted({a for a, _, _ in names} - state.keys())
    extra = sorted(state.keys() - {a for a, _, _ in names})
    if missing or extra:
        raise ConfigError(
            f"the state does not match model.kind = {cfg.kind!r}: missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    return {b: (state[a].t() if t else state[a]).contiguous() for a, b, t in names}


def check_out(out: Path, cfg: ModelConfig) -> None:
    """What `write_hf` refuses of a model (its plain config, `cfg`) and of `out`: checked before
    a training whose model it is to write as well, which holds it only in memory until then."""
    if cfg.boundary_bottleneck:  # its squeeze and expand have no place in a transformers model
        raise ConfigError(
            f"model.boundary_bottleneck = {cfg.boundary_bottleneck}: a learned bottleneck "
            "between stages cannot be expressed as a transformers model; not exported"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory")


def check_writable(out: Path) -> None:
    """That `write_hf` can build its directory beside `out` (an OSError where not): made and
    removed, before a training whose model it writes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    probe = out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}"
    probe.mkdir()
    probe.rmdir()


def write_hf(
    out: str | Path, state: dict[str, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype | None
) -> Path:
    """Write `out/model.safetensors` and `out/config.json` (in `dtype`, else the state's own).
    Built in a temporary directory beside `out` and renamed into place: a failed export leaves
    no partial checkpoint, and an existing `out` is refused rather than mixed with."""
    from safetensors.torch import save_file

    if cfg.boundary_rank:  # raw subspace weights are not the model: fold them first
        raise ConfigError(
            f"model.boundary_rank = {cfg.boundary_rank}: export the state that "
            "swarm.model.transformer.plain_state folds, with its config"
        )
    out = Path(out)
    check_out(out, cfg)
    tensors = to_hf(state, cfg)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    stored = next(iter(tensors.values())).dtype
    out.parent.mkdir(parents=True, exist_ok=True)
    # The user's files, with the user's modes (the umask's), as `torch.save` writes a file:
    # not mkdtemp's 0700, nor the 0600 safetensors gives its file.
    tmp = out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        (tmp / CONFIG).write_text(json.dumps(hf_config(cfg, stored), indent=2) + "\n")
        _saved(save_file, tensors, tmp / WEIGHTS)
        shutil.copymode(tmp / CONFIG, tmp / WEIGHTS)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _saved(save_file: Callable[..., None], tensors: dict[str, torch.Tensor], path: Path) -> None:
    """`save_file(tensors, path)`, its failure to write (a full disk) an `OSError` as every
    other write's: safetensors raises its own error class, which the commands do not catch."""
    from safetensors import SafetensorError

    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        number = int(code.group(1))
        raise OSError(number, os.strerror(number), str(path)) from e


def check_hf_config(directory: str | Path, cfg: ModelConfig) -> None:
    """Refuse a checkpoint whose `config.json` describes another architecture than `cfg` (a
    deeper model would otherwise load its first layers silently)."""
    path = Path(directory) / CONFIG
    try:
        theirs = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    ours = hf_config(cfg)
    # Not the architecture: names, types, token ids; and a llama's context may be shorter than
    # the one it was trained with (rotary positions have no table).
    free = {"architectures", "torch_dtype", "bos_token_id", "eos_token_id"}
    free |= {"max_position_embeddings"} if cfg.kind == "llama" else set()
    keys = [k for k in ours if k not in free and k in theirs]
    differ = [f"{k} = {theirs[k]!r} (the job's: {ours[k]!r})" for k in keys if theirs[k] != ours[k]]
    if theirs.get("model_type") != ours["model_type"]:
        differ.insert(0, f"model_type = {theirs.get('model_type')!r} (the job's: model.kind)")
    if theirs.get("rope_scaling"):
        differ.append(f"rope_scaling = {theirs['rope_scaling']!r} (not supported)")
    if differ:
        raise ConfigError(f"{path} describes another model: " + "; ".join(differ))


def read_hf(
    directory: str | Path, cfg: ModelConfig, layers: Iterable[int]
) -> dict[str, torch.Tensor]:
    """The parameters of `layers` (swarm names) from a Hugging Face checkpoint directory,
    reading only those tensors of `model.safetensors` (their shapes are checked when a stage
    loads them)."""
    from safetensors import safe_open

    path = Path(directory) / WEIGHTS
    wanted = {f"layers.{i}." for i in layers}
    names = [n for n in _names(cfg) if any(n[0].startswith(w) for w in wanted)]
    state: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            available = set(f.keys())
            missing = sorted(b for _, b, _ in names if b not in available)
            if missing:
                raise ConfigError(f"{path} lacks {missing[:5]} (model.kind = {cfg.kind!r})")
            for a, b, t in names:
                tensor = f.get_tensor(b)
                state[a] = tensor.t().contiguous() if t else tensor
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    return state
