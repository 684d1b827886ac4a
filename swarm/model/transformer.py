"""Causal pre-norm transformers (`gpt`, `llama`), cut into layers so that any stage can be built
alone.

Layer indices are global: 0 is the embedding, 1..n_layers are transformer blocks, n_layers + 1 is
the head (final norm and LM head). `gpt`: learned positions, LayerNorm, GELU MLP, biases. `llama`:
rotary positions (rotate-half convention, as Hugging Face's `LlamaForCausalLM`), RMSNorm, SwiGLU
MLP, grouped-query attention, no biases. A stage holds a contiguous range of them in a `StageModule`
whose parameter names (`layers.<i>.…`) are the same as in the whole model, so the union of every
stage's state_dict is the whole model's state_dict. Each layer is initialised from its own seed,
so building stage k alone gives bitwise the parameters the whole model has for those layers.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from swarm.errors import ConfigError
from swarm.job.config import JobConfig, ModelConfig, verify_init
from swarm.model.bottleneck import attach, run_layer
from swarm.model.hf import check_hf_config, read_hf
from swarm.model.partition import partition  # re-exported: every role asks it here
from swarm.model.subspace import Projected, Subspace

__all__ = [
    "DTYPES",
    "StageModule",
    "boundary_width",
    "build_model",
    "build_stage",
    "layer_costs",
    "loss_sum",
    "num_layers",
    "partition",
    "plain_state",
    "precision",
    "stage_layout",
    "subspace_of",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
}
_INIT_STD = 0.02


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        # `model.boundary_rank`: into span(U), beside the fixed table (None: as it is; no call
        # at all, so a job without a subspace computes as it always did)
        self.write: Projected | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        y = self.tok(ids) + self.pos(positions)
        return y if self.write is None else self.write.embed(y, ids)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, cfg.mlp_ratio * d)
        self.out = nn.Linear(cfg.mlp_ratio * d, d)
        self.write: Projected | None = None  # `model.boundary_rank`: proj and out into span(U)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = self.proj(att.transpose(1, 2).reshape(b, t, d))
        x = x + (a if self.write is None else self.write(a))
        m = self.out(F.gelu(self.fc(self.ln2(x))))
        return x + (m if self.write is None else self.write(m))


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class LlamaEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.write: Projected | None = None  # `model.boundary_rank`: as `Embedding`'s

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = self.tok(ids)  # positions enter as rotations of queries and keys
        return y if self.write is None else self.write.embed(y, ids)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


_Tables = tuple[torch.Tensor, torch.Tensor]  # RoPE's (cos, sin)


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, hd = cfg.d_model, cfg.d_model // cfg.n_heads
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.kv_heads, hd
        self.theta = cfg.rope_theta
        self._rope_tables: dict[tuple[int, torch.dtype, torch.device], _Tables] = {}
        self.attn_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.q = nn.Linear(d, cfg.n_heads * hd, bias=False)
        self.k = nn.Linear(d, cfg.kv_heads * hd, bias=False)
        self.v = nn.Linear(d, cfg.kv_heads * hd, bias=False)
        self.o = nn.Linear(cfg.n_heads * hd, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.gate = nn.Linear(d, cfg.swiglu_hidden, bias=False)
        self.up = nn.Linear(d, cfg.swiglu_hidden, bias=False)
        self.down = nn.Linear(cfg.swiglu_hidden, d, bias=False)
        self.write: Projected | None = None  # `model.boundary_rank`: o and down into span(U)

    def _rope(self, t: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each position's angles, [t, head_dim], computed in float64 (a pure
        function of the shape: every replica and the reference get the same bits), once per
        (length, dtype, device): a stage call on a GPU would otherwise spend a dozen small
        kernels a block rebuilding them. Not a buffer: no part of the state."""
        key = (t, like.dtype, like.device)
        tables = self._rope_tables.get(key)
        if tables is None:
            hd = self.head_dim
            inv_freq = 1.0 / self.theta ** (
                torch.arange(0, hd, 2, dtype=torch.float64, device=like.device) / hd
            )
            angles = torch.outer(torch.arange(t, dtype=torch.float64, device=like.device), inv_freq)
            angles = torch.cat((angles, angles), dim=-1)
            tables = angles.cos().to(like.dtype), angles.sin().to(like.dtype)
            self._rope_tables[key] = tables
        return tables

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = self._rope(t, q)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        # Grouped-query: query head i reads key/value head i // (n_heads / n_kv) inside the
        # attention kernel, no key/value copied out per query head.
        gqa = self.n_kv != self.n_heads
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        a = self.o(att.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
        x = x + (a if self.write is None else self.write(a))
        h = self.mlp_norm(x)
        m = self.down(F.silu(self.gate(h)) * self.up(h))
        return x + (m if self.write is None else self.write(m))


class LlamaHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


# Per family: its (embedding, block, head) classes, the parameter-name prefixes of its norms
# (initialised to 1) and of the projections into the residual stream (scaled down at init).
_FAMILIES: dict[str, tuple[tuple[type[nn.Module], ...], tuple[str, ...], tuple[str, ...]]] = {
    "gpt": ((Embedding, Block, Head), ("ln",), ("proj", "out")),
    "llama": (
        (LlamaEmbedding, LlamaBlock, LlamaHead),
        ("attn_norm.", "mlp_norm.", "norm."),
        ("o.", "down."),
    ),
}


class StageModule(nn.Module):
    """Layers `first..last` of the model, applied in order. Under `model.boundary_rank`, a stage
    after the first takes the boundary's coefficients and `tokens` (the microbatch's token ids)
    and rebuilds the residual from them; a stage before the last sends coefficients. Under
    `model.boundary_bottleneck` the layers at the cuts carry its halves (`run_layer`)."""

    def __init__(
        self,
        layers: dict[int, nn.Module],
        subspace: Subspace | None = None,
        *,
        receives: bool = False,
        sends: bool = False,
    ) -> None:
        super().__init__()
        self.indices = sorted(layers)
        self.layers = nn.ModuleDict({str(i): layers[i] for i in self.indices})
        self.subspace = subspace  # buffers only, none persistent: the state_dict is the layers'
        self.receives, self.sends = (
            receives and subspace is not None,
            sends and subspace is not None,
        )

    @property
    def needs_tokens(self) -> bool:
        """Whether `forward` needs the token ids beside its inputs (a subspace stage after 0)."""
        return self.subspace is not None and self.indices[0] > 0

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        if self.indices[0] == 0:
            tokens = x  # the first stage's inputs are the token ids
        if self.receives:
            if tokens is None:
                raise ValueError("a subspace boundary needs the microbatch's token ids")
            x = self.subspace.decode(x, tokens)  # type: ignore[union-attr]
        for layer in self.layers.values():
            x = run_layer(layer, x)  # through a learned bottleneck's half at a cut
        if self.sends:
            assert tokens is not None
            x = self.subspace.encode(x, tokens)  # type: ignore[union-attr]
        return x


def num_layers(cfg: ModelConfig) -> int:
    return cfg.n_layers + 2


def layer_costs(cfg: ModelConfig) -> list[float]:
    """Forward FLOPs per sequence of each layer; backward costs about twice as much everywhere,
    so the ratio between layers (all that partitioning needs) is the same."""
    d, t, v = cfg.d_model, cfg.seq_len, cfg.vocab_size
    # The embedding is a lookup and an add: memory-bound, costed as a few passes over [t, d].
    embedding = 4.0 * t * d
    if cfg.kind == "llama":
        kv = cfg.kv_heads * (d // cfg.n_heads)
        projections = 2 * d * d + 2 * d * kv + 3 * d * cfg.swiglu_hidden
    else:
        projections = 4 * d * d + 2 * cfg.mlp_ratio * d * d
    block = 2.0 * t * projections + 4.0 * t * t * d
    head = 2.0 * t * d * v + 10.0 * t * d
    return [embedding] + [block] * cfg.n_layers + [head]


def _layer_seed(seed: int, index: int) -> int:
    digest = hashlib.blake2b(f"swarm-layer/{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _build_layer(cfg: ModelConfig, index: int, seed: int) -> nn.Module:
    """Construct layer `index` without touching the global RNG, then initialise it from its own
    generator in float64 on the CPU, so every process and device gets the same bits."""
    (embedding, block, head), norms, residual = _FAMILIES[cfg.kind]
    kind = embedding if index == 0 else block if index <= cfg.n_layers else head
    with torch.device("meta"):
        layer = kind(cfg)
    layer = layer.to_empty(device="cpu").to(torch.float64)
    gen = torch.Generator().manual_seed(_layer_seed(seed, index))
    residual_std = _INIT_STD / math.sqrt(2 * cfg.n_layers)  # GPT-2: scale residual outputs
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif name.startswith(norms):
                p.fill_(1.0)
            else:
                std = residual_std if name.startswith(residual) else _INIT_STD
                p.normal_(0.0, std, generator=gen)
    return layer


def _from_checkpoint(job: JobConfig, module: StageModule) -> None:
    """`module`'s parameters from `model.init_from` (only its layers' tensors are read), in
    float64 before the cast to the job's dtype, as a seeded initialisation would be."""
    cfg = verify_init(job).model  # a checkpoint changed since the job was pinned is refused
    assert cfg.init_from is not None
    check_hf_config(cfg.init_from, cfg)
    state = read_hf(cfg.init_from, cfg, module.indices)
    own = module.state_dict()
    for name, tensor in state.items():
        if tensor.shape != own[name].shape:
            raise ConfigError(
                f"{cfg.init_from}: {name} is {list(tensor.shape)}, the job's model wants "
                f"{list(own[name].shape)}"
            )
    module.load_state_dict({k: v.to(torch.float64) for k, v in state.items()}, strict=True)


def _built(
    job: JobConfig, indices: Sequence[int], device: torch.device | str, *, boundaries: bool
) -> StageModule:
    layers = {i: _build_layer(job.model, i, job.training.seed) for i in indices}
    sub = subspace_of(job)
    if sub is not None:  # every layer before the last boundary writes into span(U)
        last = partition(layer_costs(job.model), job.training.stages)[-1].start
        for i, layer in layers.items():
            if i < last:
                layer.write = Projected(sub)
    _bottleneck(job, layers, job.training.seed)
    module = StageModule(
        layers,
        sub,
        receives=boundaries and indices[0] > 0,
        sends=boundaries and indices[-1] < num_layers(job.model) - 1,
    )
    if job.model.init_from is not None:
        _from_checkpoint(job, module)
    return module.to(device=device, dtype=DTYPES[job.training.dtype])


def _bottleneck(job: JobConfig, layers: dict[int, nn.Module], seed: int | None) -> None:
    """`model.boundary_bottleneck`: the halves of the learned bottleneck at the cuts `layers`
    touch (`swarm.model.bottleneck`); nothing without it."""
    if job.model.boundary_bottleneck:
        cuts = partition(layer_costs(job.model), job.training.stages)
        attach(layers, cuts, job.model.d_model, job.model.boundary_bottleneck, seed)


def plain_state(
    job: JobConfig, state: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """The whole model's `state` as a model without a subspace boundary computes it, and that
    model's config: what an export writes (`swarm.model.hf.write_hf`), loadable anywhere. A job
    without `model.boundary_rank` is returned as it is."""
    sub = subspace_of(job)
    if sub is None:
        return state, job.model
    last = partition(layer_costs(job.model), job.training.stages)[-1].start
    folded = sub.fold(state, _FAMILIES[job.model.kind][2], last)
    return folded, replace(job.model, boundary_rank=0)


def boundary_width(cfg: ModelConfig) -> int:
    """Features per token that cross a stage boundary: `boundary_rank` or
    `boundary_bottleneck`, else `d_model`."""
    return cfg.boundary_rank or cfg.boundary_bottleneck or cfg.d_model


def subspace_of(job: JobConfig) -> Subspace | None:
    """The job's subspace boundary (`model.boundary_rank`), in float64 on the CPU; None when
    its boundaries carry the full residual."""
    cfg = job.model
    if not cfg.boundary_rank:
        return None
    positions = cfg.seq_len if cfg.kind == "gpt" else 0  # llama: rotary, nothing to add
    rank, seed = cfg.boundary_rank, job.training.seed
    return Subspace(cfg.d_model, rank, cfg.vocab_size, positions, seed, cfg.boundary_table)


def _stage_layers(job: JobConfig, stage: int) -> range:
    ranges = partition(layer_costs(job.model), job.training.stages)
    if not 0 <= stage < len(ranges):
        raise ConfigError(f"stage {stage} does not exist; the job has stages 0..{len(ranges) - 1}")
    return ranges[stage]


def build_stage(job: JobConfig, stage: int, device: torch.device | str = "cpu") -> StageModule:
    """Stage `stage` of `job`'s model on `device`, in the job's dtype."""
    return _built(job, _stage_layers(job, stage), device, boundaries=True)


def stage_layout(job: JobConfig, stage: int) -> StageModule:
    """Stage `stage` of `job`'s model on the meta device, in the job's dtype: its parameters'
    names, shapes and dtypes without their values (what a state of the stage must look like),
    at no cost in memory or time however large the model."""
    (embedding, block, head), _, _ = _FAMILIES[job.model.kind]
    layers: dict[int, nn.Module] = {}
    with torch.device("meta"):
        for i in _stage_layers(job, stage):
            kind = embedding if i == 0 else block if i <= job.model.n_layers else head
            layers[i] = kind(job.model)
        _bottleneck(job, layers, None)
    return StageModule(layers).to(dtype=DTYPES[job.training.dtype])


def build_model(job: JobConfig, device: torch.device | str = "cpu") -> StageModule:
    """The whole model as one stage: the reference `swarm local` trains this."""
    return _built(job, range(num_layers(job.model)), device, boundaries=False)


def precision(job: JobConfig, device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
    """Where a stage computes (forward, and a Backward's recompute): bfloat16 autocast for
    `training.precision = "bf16-mixed"` (parameters and gradients stay float32), else as is."""
    if job.training.precision == "bf16-mixed":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum over samples of each sample's mean token cross-entropy. Summing (not averaging) over
    samples makes a step's gradient the plain sum of its microbatches' gradients, divided once by
    the step's sample count at commit, wherever the microbatches were computed."""
    b, t, v = logits.shape
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(wide.reshape(b * t, v), targets.reshape(b * t), reduction="sum") / t
