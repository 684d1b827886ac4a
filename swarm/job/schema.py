"""The job schema: every section of a job file as a frozen, validated dataclass.

Each field is documented with its unit and default, so this file is the reference for job files.
The dataclasses are frozen because a job is shared by every role and must not change under them
(its fingerprint names it); they validate in `__post_init__` (through `swarm.job.coerce.Section`),
so jobs built in code are held to the rules jobs read from files are. Reading TOML is
`swarm.job.config`'s; what identifies a job's maths is `swarm.job.fingerprint`'s (it reads
this schema; the schema does not call it).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

from swarm.errors import ConfigError
from swarm.job.coerce import GE0, GE1, GT0, UNIT, Check, Section, not_allowed
from swarm.job.coerce import checked_field as _f  # short: nearly every field uses it
from swarm.job.small_boundary import DEFAULT_TABLE, check_small_boundary
from swarm.job.trust import TrustConfig

__all__ = [
    "CHECKPOINT_EVERY",
    "FILE_DATA",
    "MAX_LAYERS",
    "MAX_SPEC_BYTES",
    "MAX_STAGES",
    "NAME_RE",
    "SECTIONS",
    "Codec",
    "CompressionConfig",
    "DataConfig",
    "JobConfig",
    "MiB",
    "ModelConfig",
    "OptimizerConfig",
    "PoolConfig",
    "RebalanceConfig",
    "RuntimeConfig",
    "TrainingConfig",
    "TrustConfig",
    "token_width",
]

MiB = 1 << 20

# Job names appear in MQTT topics and file names, so keep them to a safe alphabet.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

# Bounds on a job's size, so that no job can stall the roles that read it: the scheduler and every
# idle peer partition a job's layers into its stages (`swarm.model.transformer.partition`, about
# stages x layers steps) and announce its spec on the bus. Generous: the largest open models have
# ~130 blocks (32x fewer), and a pipeline of 512 stages already waits 1022 hops per microbatch.
MAX_LAYERS = 4096  #: model.n_layers at most (transformer blocks)
MAX_STAGES = 512  #: training.stages at most
MAX_SPEC_BYTES = MiB  #: a job file's size at most (bytes of UTF-8): data belongs in data.path
# Not 0: without a checkpoint a lost stage sends the whole job back to step 0.
CHECKPOINT_EVERY = 100  #: training.checkpoint_every when unset (steps)


# A trainer's window at most: what one of its leases or reports may name (the job API refuses
# more, `scheduler.trainer_calls.MAX_REPORTED`, since any token holder may call it).
MAX_IN_FLIGHT = 1 << 16
IN_FLIGHT: Check = (lambda v: 1 <= v <= MAX_IN_FLIGHT, f"in 1..{MAX_IN_FLIGHT}")
# A lease's timeout at most: a trainer id unheard this long holds no lease, and the job API
# forgets which caller held it (`scheduler.trainer_keys`).
MAX_LEASE_TIMEOUT_S = 3600.0
LEASE_TIMEOUT: Check = (lambda v: 0 < v <= MAX_LEASE_TIMEOUT_S, f"in (0, {MAX_LEASE_TIMEOUT_S:g}]")
# A call's or a round's deadline at most. gRPC turns a deadline into an absolute time in
# nanoseconds: past ~9.2e9 s it overflows and every call failed at once as "Deadline Exceeded",
# which read as peers that did not answer. A day is far past any step.
MAX_DEADLINE_S = 86400.0
DEADLINE: Check = (lambda v: 0 < v <= MAX_DEADLINE_S, f"> 0 and <= {MAX_DEADLINE_S:g}")
# The largest message gRPC can be told to take (its lengths are 32-bit): past it every client
# the job builds raised OverflowError, naming no key.
GRPC_MAX_MESSAGE = 2**31 - 1
MESSAGE_BYTES: Check = (lambda v: 1 <= v <= GRPC_MAX_MESSAGE, f">= 1 and <= {GRPC_MAX_MESSAGE}")


@dataclass(frozen=True)
class ModelConfig(Section):
    """`[model]`: the network's shape. Layers are embedding, `n_layers` blocks, head."""

    section: ClassVar[str] = "model"
    #: model family, both decoder-only transformers: "gpt" (learned positions, LayerNorm, GELU
    #: MLP) or "llama" (rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention)
    kind: Literal["gpt", "llama"] = "gpt"
    vocab_size: int = _f(256, GE1)  #: tokens in the vocabulary (count; bytes for text data)
    d_model: int = _f(64, GE1)  #: width of the residual stream (features per token)
    n_layers: int = _f(4, GE1)  #: transformer blocks (count; at most MAX_LAYERS)
    n_heads: int = _f(4, GE1)  #: attention heads per block (count; must divide d_model)
    seq_len: int = _f(64, GE1)  #: context length (tokens per sample)
    mlp_ratio: int = _f(4, GE1)  #: gpt: MLP hidden width as a multiple of d_model
    n_kv_heads: int = _f(0, GE0)  #: llama: key/value heads (count; divides n_heads); 0: n_heads
    mlp_hidden: int = _f(0, GE0)  #: llama: SwiGLU hidden width (features); 0: about 8/3 d_model
    rope_theta: float = _f(10000.0, GT0)  #: llama: rotary base (positions per radian scale)
    norm_eps: float = _f(1e-5, GT0)  #: llama: RMSNorm's floor on the mean square
    #: a Hugging Face checkpoint directory (model.safetensors, config.json; relative to the job
    #: file) to start from instead of the seeded initialisation: each stage reads its own tensors
    init_from: Path | None = None
    # Hex sha256 of init_from's manifest (every file's path, size and sha256: swarm.job.manifest):
    # pinned at load (or by the scheduler at submit) so the fingerprint names the checkpoint, a
    # changed file is refused, and a machine without the directory fetches it by this name.
    init_sha256: str | None = None
    #: features per token crossing each stage boundary (`swarm.model.subspace`); 0: all d_model
    boundary_rank: int = _f(0, GE0)
    #: the subspace boundary's fixed table E: the std of each entry (token rows, gpt's position
    #: rows too), drawn from the job's seed; 0: no fixed table (`swarm.model.subspace`)
    boundary_table: float = _f(DEFAULT_TABLE, GE0)
    #: learned features per token crossing each boundary (`swarm.model.bottleneck`); 0: none
    boundary_bottleneck: int = _f(0, GE0)

    def _validate(self) -> None:
        check_small_boundary(self)  # never a silent full boundary
        if self.n_layers > MAX_LAYERS:
            allowed = f"an integer in 1..{MAX_LAYERS} (swarm's MAX_LAYERS)"
            raise not_allowed("model.n_layers", self.n_layers, allowed)
        if self.d_model % self.n_heads:
            allowed = f"a multiple of model.n_heads = {self.n_heads}"
            raise not_allowed("model.d_model", self.d_model, allowed)
        if self.init_sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", self.init_sha256):
            raise not_allowed("model.init_sha256", self.init_sha256, "64 lowercase hex digits")
        if self.kind != "llama":
            return
        if self.n_heads % self.kv_heads:
            allowed = f"a divisor of model.n_heads = {self.n_heads}"
            raise not_allowed("model.n_kv_heads", self.n_kv_heads, allowed)
        if (self.d_model // self.n_heads) % 2:
            allowed = "d_model / n_heads even (rotary embeddings turn pairs of features)"
            raise not_allowed("model.d_model", self.d_model, allowed)

    @property
    def kv_heads(self) -> int:
        """Key/value heads of a llama block (`n_kv_heads`, or `n_heads` when 0)."""
        return self.n_kv_heads or self.n_heads

    @property
    def swiglu_hidden(self) -> int:
        """A llama block's MLP width: `mlp_hidden`, or 8/3 d_model rounded up to a multiple of
        8 (Llama's rule: as many parameters as a 4x GELU MLP)."""
        return self.mlp_hidden or (8 * self.d_model // 3 + 7) // 8 * 8


FILE_DATA = ("text", "tokens")  # data kinds read from a file, pinned by its sha256


def token_width(vocab_size: int) -> int:
    """Bytes per token id in a token file: 2 (uint16) when the vocabulary fits, else 4."""
    return 2 if vocab_size <= 1 << 16 else 4


@dataclass(frozen=True)
class DataConfig(Section):
    """`[data]`: where samples come from; each sample is `seq_len + 1` tokens."""

    section: ClassVar[str] = "data"
    #: "text": a UTF-8 file read as bytes; "tokens": a flat file of token ids (`swarm
    #: prepare-data`; uint16 when model.vocab_size <= 65536, else uint32); "synthetic": seeded
    kind: Literal["text", "tokens", "synthetic"] = "synthetic"
    path: Path | None = None  #: the data file (text, tokens; relative to the job file's directory)
    # Hex sha256 of the data file's bytes. Filled in at load so the fingerprint names the data
    # that was checked then (and travels without the file); set it in a job file to pin the data.
    sha256: str | None = None
    #: share of the data file held out at its end for evaluation (fraction; 0: none held out)
    val_fraction: float = _f(0.0, UNIT)
    #: a validation file of the same kind (relative to the job file's directory); evaluation
    #: reads it instead of the data file's tail
    val_path: Path | None = None
    val_sha256: str | None = None  # as `sha256`, for `val_path`

    def _validate(self) -> None:
        if self.kind in FILE_DATA and self.path is None:
            raise ConfigError(
                f'data.path is required when data.kind = "{self.kind}"; use a path string'
            )
        for key in ("sha256", "val_sha256"):
            value = getattr(self, key)
            if value is not None and not re.fullmatch(r"[0-9a-f]{64}", value):
                raise not_allowed(f"data.{key}", value, "64 lowercase hex digits")
        if self.kind not in FILE_DATA and (self.val_fraction or self.val_path is not None):
            key = "val_fraction" if self.val_fraction else "val_path"
            allowed = 'unset: a validation split needs data.kind = "text" or "tokens"'
            raise not_allowed(f"data.{key}", getattr(self, key), allowed)
        if self.val_fraction and self.val_path is not None:
            raise not_allowed(
                "data.val_fraction", self.val_fraction, "unset when data.val_path is set"
            )


@dataclass(frozen=True)
class TrainingConfig(Section):
    """`[training]`: the step protocol's sizes, the seed and the numeric type."""

    section: ClassVar[str] = "training"
    stages: int = _f(check=GE1)  #: pipeline stages (count; <= model.n_layers + 2, MAX_STAGES)
    microbatch_size: int = _f(check=GE1)  #: samples per microbatch (the unit of routing)
    target_batch_size: int = _f(check=GE1)  #: samples per optimizer step
    steps: int = _f(check=GE1)  #: optimizer steps to run (count)
    seed: int = _f(0, GE0)  #: seeds parameters and the (seed, step, index) -> data mapping
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"  #: parameter and compute type
    #: "fp32": compute in `dtype`; "bf16-mixed": float32 parameters, optimizer state and
    #: gradient sums, bfloat16 autocast compute, bf16 on the wire unless [compression] says
    precision: Literal["fp32", "bf16-mixed"] = "fp32"
    #: steps between checkpoints (0 = never); unset: `CHECKPOINT_EVERY`, under local steps
    #: rounded up to a round's end (`JobConfig`, when the job is read; never None in a job)
    checkpoint_every: int | None = _f(None, GE0)
    keep_checkpoints: int = _f(3, GE1)  #: sealed checkpoints kept, the newest (older: deleted)
    #: largest L2 norm of the whole model's averaged gradient (all stages); larger ones are
    #: scaled down to it before the optimizer step (0 = no clipping)
    grad_clip: float = _f(0.0, GE0)
    #: steps between evaluations of the validation loss (0 = never); the parameters after
    #: every multiple of it, and the final ones, are evaluated
    eval_every: int = _f(0, GE0)
    eval_microbatches: int = _f(4, GE1)  #: fixed validation microbatches per evaluation (count)
    #: one step of staleness: step t computes on the parameters before step t-1's update, so
    #: each step's averaging and update overlap the next step's microbatches (docs/jobs.md)
    delayed_update: bool = False
    #: float32 matmuls on a GPU's TF32 tensor cores (faster; about 10 mantissa bits, so no
    #: longer exact against a float32 reference); false: IEEE float32. Changes nothing on a CPU
    tf32: bool = False

    @property
    def microbatches_per_step(self) -> int:
        """M = target_batch_size / microbatch_size (count)."""
        return self.target_batch_size // self.microbatch_size

    def _validate(self) -> None:
        if self.stages > MAX_STAGES:
            allowed = f"an integer in 1..{MAX_STAGES} (swarm's MAX_STAGES)"
            raise not_allowed("training.stages", self.stages, allowed)
        if self.target_batch_size % self.microbatch_size:
            allowed = f"a multiple of training.microbatch_size = {self.microbatch_size}"
            raise not_allowed("training.target_batch_size", self.target_batch_size, allowed)
        if self.precision == "bf16-mixed" and self.dtype != "float32":
            allowed = '"float32" when training.precision = "bf16-mixed" (the master weights)'
            raise not_allowed("training.dtype", self.dtype, allowed)


@dataclass(frozen=True)
class OptimizerConfig(Section):
    """`[optimizer]`: the update every replica applies identically at commit."""

    section: ClassVar[str] = "optimizer"
    kind: Literal["adamw", "sgd"] = _f()  #: optimizer algorithm
    lr: float = _f(check=GT0)  #: learning rate (parameter units per gradient unit)
    weight_decay: float = _f(0.0, GE0)  #: decoupled (adamw) or L2 (sgd) decay per step (fraction)
    betas: tuple[float, float] = _f((0.9, 0.999), UNIT)  #: adamw moment decay rates (fractions)
    eps: float = _f(1e-8, GT0)  #: adamw denominator floor (gradient units)
    momentum: float = _f(0.0, UNIT)  #: sgd momentum (fraction)
    #: learning rate after warm-up, over `training.steps`: held, or decayed to `min_lr`
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = _f(0, GE0)  #: steps whose rate rises linearly to `lr` (count)
    min_lr: float = _f(0.0, GE0)  #: where `cosine` and `linear` end (parameter units)

    def _validate(self) -> None:
        if self.min_lr > self.lr:
            raise not_allowed("optimizer.min_lr", self.min_lr, f"at most optimizer.lr = {self.lr}")


Codec = Literal["none", "fp16", "bf16", "int8_blockwise", "hadamard3"]


@dataclass(frozen=True)
class CompressionConfig(Section):
    """`[compression]`: how activations and gradients are encoded on the wire."""

    section: ClassVar[str] = "compression"
    wire: Codec = "none"  #: codec of both directions between stages, unless set apart below
    forward: Literal["", Codec] = ""  #: codec of activations (stage outputs); "": `wire`
    backward: Literal["", Codec] = ""  #: codec of their gradients; "": `wire`
    block_size: int = _f(2048, GE1)  #: values per int8 absmax block (count)
    #: codec of gradient parts exchanged by a pool's averaging; "none" keeps the result exact
    averaging: Codec = "none"
    #: a lossy `averaging` codec carries what it dropped into the next step's round
    error_feedback: bool = True

    def _validate(self) -> None:
        for direction in ("forward", "backward"):  # resolved once: readers see a codec
            if not getattr(self, direction):
                object.__setattr__(self, direction, self.wire)


@dataclass(frozen=True)
class PoolConfig(Section):
    """`[pool]`: how the replicas of a stage combine their work (docs/jobs.md, "Pool modes").
    "step": every step the pool averages its gradients and applies one update. "local": each
    replica applies the optimizer every step to the samples it took itself; every `sync_every`
    steps the pool averages the replicas' pseudo-gradients (the round's start minus their
    parameters, weighted by their samples) and applies an outer SGD step with Nesterov momentum
    to the parameters every replica then continues from (DiLoCo)."""

    section: ClassVar[str] = "pool"
    mode: Literal["step", "local"] = "step"  #: per-step averaging, or local steps and rounds
    sync_every: int = _f(16, GE1)  #: steps per round with mode = "local" (H; count)
    outer_lr: float = _f(0.7, GT0)  #: the outer SGD step's learning rate (pseudo-gradient units)
    outer_momentum: float = _f(0.9, UNIT)  #: its Nesterov momentum (fraction)
    #: "eager": a round's averaging runs while the next round trains, each replica applying its
    #: own fresh share at once and the others' one round late (with mode = "local", or with
    #: mode = "step" and training.delayed_update: a round of one step, the job's optimizer for
    #: the outer one, `swarm.job.rule`)
    overlap: Literal["none", "eager"] = "none"


@dataclass(frozen=True)
class RebalanceConfig(Section):
    """`[rebalance]`: moving peers from over-served stages to the bottleneck; the tuning that
    `swarm.policy.rebalance.plan_move` takes (its docstring explains each check). None of these
    change the maths."""

    section: ClassVar[str] = "rebalance"
    enabled: bool = True  #: let the scheduler move peers between stages
    period_s: float = _f(60.0, GT0)  #: seconds between two decisions
    #: a move must raise the bottleneck by more than this factor, unless the bottleneck is more
    #: than this factor below the mean stage total (then any gain will do); 1: any gain
    hysteresis: float = _f(1.05, GE1)
    min_dwell_s: float = _f(300.0, GE0)  #: a moved peer stays put at least this long (s)
    move_cost_s: float = _f(60.0, GE0)  #: seconds a moved peer serves nobody (drain, download)
    horizon_s: float = _f(3600.0, GT0)  #: seconds a move's gain lasts, weighed against its cost

    def _validate(self) -> None:
        if self.horizon_s <= self.move_cost_s:
            allowed = f"a number > rebalance.move_cost_s = {self.move_cost_s}"
            raise not_allowed("rebalance.horizon_s", self.horizon_s, allowed)


@dataclass(frozen=True)
class RuntimeConfig(Section):
    """`[runtime]`: networking and concurrency; none of these change the maths."""

    section: ClassVar[str] = "runtime"
    #: microbatches a trainer keeps in flight (count); "auto": what the stages' activation caches
    #: hold, within 8 where they say nothing and 64 at most (`swarm.policy.window`)
    max_in_flight: int | Literal["auto"] = _f("auto", IN_FLIGHT)
    #: "push": stages send activations and gradients straight to each other; "relay": the
    #: trainer carries every one (the carry plane, the first; its link carries 3x a server's)
    data_plane: Literal["push", "relay"] = "push"
    max_queue: int = _f(64, GE1)  #: pushed microbatches a replica queues before it says busy
    rpc_timeout_s: float = _f(60.0, DEADLINE)  #: deadline of each Forward/Backward call (seconds)
    #: deadline of a step's commit/averaging (seconds)
    commit_timeout_s: float = _f(120.0, DEADLINE)
    chunk_bytes: int = _f(4 * MiB, GE1)  #: messages larger than this are streamed in chunks (bytes)
    #: gRPC max message size (bytes; > chunk_bytes)
    max_message_bytes: int = _f(64 * MiB, MESSAGE_BYTES)
    max_tensor_bytes: int = _f(1024 * MiB, GE1)  #: largest tensor a server accepts (bytes)
    activation_cache: int = _f(64, GE0)  #: microbatches whose activations a server keeps (count)
    #: a pool round waits this long for a replica (s)
    averaging_timeout_s: float = _f(60.0, DEADLINE)
    #: averaging rounds one step may fail (no commit between) before the job fails (count; a
    #: round that only voided replicas past the norm bound, once each a step, is not counted)
    max_commit_rounds: int = _f(10, GE1)
    #: unreported leased microbatches go elsewhere (s)
    lease_timeout_s: float = _f(60.0, LEASE_TIMEOUT)
    #: bytes of boundary tensors a trainer keeps to replay lost gradients without the pipeline
    boundary_cache_bytes: int = _f(256 * MiB, GE0)
    #: bytes of applied updates kept for followers (copies, standbys); one further behind copies
    update_log_bytes: int = _f(4096 * MiB, GE1)
    #: replicas every stage gets before any stage gets more, and keeps when peers are moved to
    #: the bottleneck (count; 0: the scheduler's `--min-replicas`, 1 unless it says)
    min_replicas: int = _f(0, GE0)
    #: peers per stage following it, to take it over if lost (count); "auto": one where a peer
    #: the job does not need serving has room (`swarm.policy.spares`), else none
    standby: int | Literal["auto"] = _f("auto", GE0)
    #: seconds with no committed step before a job stops, or shows `stalled`, naming the cause
    patience_s: float = _f(600.0, GT0)

    def _validate(self) -> None:
        if self.max_message_bytes <= self.chunk_bytes:
            allowed = f"an integer > runtime.chunk_bytes = {self.chunk_bytes}"
            raise not_allowed("runtime.max_message_bytes", self.max_message_bytes, allowed)


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """A whole job file. `training` and `optimizer` have required keys, so they have no default."""

    name: str  #: job name (letters, digits, ".", "_", "-"); defaults to the job file's stem
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig
    optimizer: OptimizerConfig
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    trust: TrustConfig = field(default_factory=TrustConfig)

    def __post_init__(self) -> None:
        if self.training.checkpoint_every is None:  # frozen: resolved once, as read
            every = _default_checkpoint_every(self.pool)
            object.__setattr__(self, "training", replace(self.training, checkpoint_every=every))
        if not isinstance(self.name, str) or not NAME_RE.fullmatch(self.name):
            allowed = 'a string of 1-64 letters, digits, ".", "_" or "-", starting alphanumeric'
            raise not_allowed("name", self.name, allowed)
        if self.training.stages > self.model.n_layers + 2:  # embedding + blocks + head
            allowed = f"an integer <= model.n_layers + 2 = {self.model.n_layers + 2}"
            raise not_allowed("training.stages", self.training.stages, allowed)
        narrow = (("boundary_rank", "leave the subspace"), ("boundary_bottleneck", "lack it"))
        for key, why in narrow:  # a small boundary: between stages, from its own start
            value = getattr(self.model, key)
            if value and self.training.stages < 2:  # no boundary to narrow
                allowed = "0 with training.stages = 1 (a small boundary needs two stages or more)"
                raise not_allowed(f"model.{key}", value, allowed)
            if value and self.model.init_from is not None:
                allowed = f"0 with model.init_from (a full model's weights {why})"
                raise not_allowed(f"model.{key}", value, allowed)
        if self.data.kind == "text" and self.model.vocab_size < 256:  # text tokens are bytes
            allowed = 'an integer >= 256 when data.kind = "text"'
            raise not_allowed("model.vocab_size", self.model.vocab_size, allowed)
        if self.pool.mode == "local":
            self._check_local()
        elif self.pool.overlap == "eager" and not self.training.delayed_update:
            allowed = (
                '"none" with pool.mode = "step" and training.delayed_update = false (eager needs '
                '"local", or delayed_update: its averaging is what overlaps)'
            )
            raise not_allowed("pool.overlap", self.pool.overlap, allowed)
        elif self.pool.overlap == "eager" and self.training.grad_clip > 0:
            allowed = '0 with pool.overlap = "eager" (replicas of a stage hold different gradients)'
            raise not_allowed("training.grad_clip", self.training.grad_clip, allowed)
        if self.pool.overlap == "eager" and self.training.eval_every:
            allowed = (
                '0 with pool.overlap = "eager": the replicas share no parameters between rounds '
                "to evaluate (the final model, their mean, is what to evaluate)"
            )
            raise not_allowed("training.eval_every", self.training.eval_every, allowed)

    def _check_local(self) -> None:
        """What local steps cannot do (yet), said when the job is read."""
        training, every = self.training, self.pool.sync_every
        if training.delayed_update:
            allowed = 'false with pool.mode = "local" (a round already hides the averaging)'
            raise not_allowed("training.delayed_update", True, allowed)
        if training.grad_clip > 0:
            allowed = '0 with pool.mode = "local" (replicas of a stage hold different gradients)'
            raise not_allowed("training.grad_clip", training.grad_clip, allowed)
        # Rounds end every `sync_every` steps: joins, moves and checkpoints wait for one, and an
        # evaluation must see parameters every replica shares (those of a round's start).
        for key in ("checkpoint_every", "eval_every"):
            value = getattr(training, key)
            if value % every:
                allowed = f'a multiple of pool.sync_every = {every} with pool.mode = "local"'
                if key == "checkpoint_every":  # unset, it is one
                    allowed += f" (or leave it unset: {_default_checkpoint_every(self.pool)})"
                raise not_allowed(f"training.{key}", value, allowed)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every key (paths as strings, tuples as lists)."""
        return json.loads(json.dumps(asdict(self), default=str))  # type: ignore[no-any-return]


def _default_checkpoint_every(pool: PoolConfig) -> int:
    """training.checkpoint_every when a job leaves it unset: `CHECKPOINT_EVERY` steps, under
    local steps rounded up to a multiple of `pool.sync_every` (a checkpoint needs parameters
    every replica shares: a round's start), so the default fits any round length (112 steps for
    the default 16)."""
    if pool.mode != "local":
        return CHECKPOINT_EVERY
    return -(-CHECKPOINT_EVERY // pool.sync_every) * pool.sync_every


_CLASSES = (ModelConfig, DataConfig, TrainingConfig, OptimizerConfig, CompressionConfig)
SECTIONS: dict[str, type[Section]] = {
    c.section: c for c in (*_CLASSES, RuntimeConfig, RebalanceConfig, PoolConfig, TrustConfig)
}
