"""Job files: TOML parsed into frozen, validated dataclasses.

Every check raises one `ConfigError` naming the full key (`training.dtype`), the bad value and what
is allowed, so a user can fix a job file from the message alone. The dataclasses validate in
`__post_init__`, so jobs built in code are held to the same rules as jobs read from files.
"""

from __future__ import annotations

import codecs
import difflib
import hashlib
import json
import math
import re
import tomllib
import types
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, get_args, get_origin, get_type_hints

from swarm.errors import ConfigError

__all__ = [
    "CompressionConfig",
    "DataConfig",
    "JobConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RebalanceConfig",
    "RuntimeConfig",
    "TrainingConfig",
    "data_sha256",
    "load_job",
    "parse_job",
    "verify_data",
]

MiB = 1 << 20

# (predicate, words appended to the type's description in messages)
Check = tuple[Callable[[Any], bool], str]
GE0: Check = (lambda v: v >= 0, ">= 0")
GE1: Check = (lambda v: v >= 1, ">= 1")
GT0: Check = (lambda v: v > 0, "> 0")
UNIT: Check = (lambda v: 0 <= v < 1, "in [0, 1)")
# Job names appear in MQTT topics and file names, so keep them to a safe alphabet.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _f(default: Any = MISSING, check: Check | None = None) -> Any:
    return field(default=default, metadata={"check": check} if check else {})


def _show(value: Any) -> str:
    """Render a value as it would look in TOML-ish JSON (strings in double quotes)."""
    try:
        return json.dumps(str(value) if isinstance(value, Path) else value)
    except TypeError:
        return repr(value)


def _fail(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{key} = {_show(value)} is not allowed; use {allowed}")


def _describe(hint: Any, check: Check | None) -> str:
    if get_origin(hint) is Literal:
        return "one of " + ", ".join(_show(a) for a in get_args(hint))
    words = {
        int: "an integer",
        float: "a number",
        str: "a string",
        Path: "a path string",
        bool: "true or false",
    }
    if get_origin(hint) is tuple:
        text = f"a list of {len(get_args(hint))} numbers"
    elif get_origin(hint) is types.UnionType:  # `X | None`: None means "not set"
        text = words[next(a for a in get_args(hint) if a is not type(None))]
    else:
        text = words[hint]
    return f"{text} {check[1]}" if check else text


def _coerce(key: str, value: Any, hint: Any, check: Check | None) -> Any:
    """Return `value` in its canonical Python type, or raise naming `key` and what is allowed."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is types.UnionType and value is None:
        return None
    if origin is types.UnionType:
        hint = next(a for a in args if a is not type(None))
    number = isinstance(value, int | float) and not isinstance(value, bool)
    items: list[Any] = []
    if origin is Literal:
        ok = isinstance(value, str) and value in args
    elif origin is tuple:
        ok = isinstance(value, list | tuple) and len(value) == len(args)
        ok = ok and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
        items = [float(v) for v in value] if ok else []
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok, value = number, float(value) if number else value
    elif hint is Path:
        ok, value = isinstance(value, str | Path), Path(value) if isinstance(value, str) else value
    else:
        ok = isinstance(value, hint)
    if ok and check:
        ok = all(check[0](v) for v in items) if origin is tuple else check[0](value)
    if not ok:
        raise _fail(key, value, _describe(hint, check))
    return tuple(items) if origin is tuple else value


def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)  # cheap enough: jobs are built rarely


class _Section:
    """Shared validation: per-field type and range checks, then the section's own rules."""

    section: ClassVar[str]

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            key, hint = f"{self.section}.{f.name}", _hints(type(self))[f.name]
            value = _coerce(key, getattr(self, f.name), hint, f.metadata.get("check"))
            object.__setattr__(self, f.name, value)  # frozen: normalise in place once
        self._validate()

    def _validate(self) -> None:
        """Cross-field rules inside one section; override where needed."""


@dataclass(frozen=True)
class ModelConfig(_Section):
    """`[model]`: the network's shape. Layers are embedding, `n_layers` blocks, head."""

    section: ClassVar[str] = "model"
    #: model family, both decoder-only transformers: "gpt" (learned positions, LayerNorm, GELU
    #: MLP) or "llama" (rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention)
    kind: Literal["gpt", "llama"] = "gpt"
    vocab_size: int = _f(256, GE1)  #: tokens in the vocabulary (count; bytes for text data)
    d_model: int = _f(64, GE1)  #: width of the residual stream (features per token)
    n_layers: int = _f(4, GE1)  #: transformer blocks (count)
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
    # Hex sha256 of init_from's model.safetensors: pinned at load (or by the scheduler at submit)
    # so the fingerprint names the weights, and a changed file is refused.
    init_sha256: str | None = None

    def _validate(self) -> None:
        if self.d_model % self.n_heads:
            allowed = f"a multiple of model.n_heads = {self.n_heads}"
            raise _fail("model.d_model", self.d_model, allowed)
        if self.init_sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", self.init_sha256):
            raise _fail("model.init_sha256", self.init_sha256, "64 lowercase hex digits")
        if self.kind != "llama":
            return
        if self.n_heads % self.kv_heads:
            allowed = f"a divisor of model.n_heads = {self.n_heads}"
            raise _fail("model.n_kv_heads", self.n_kv_heads, allowed)
        if (self.d_model // self.n_heads) % 2:
            allowed = "d_model / n_heads even (rotary embeddings turn pairs of features)"
            raise _fail("model.d_model", self.d_model, allowed)

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
class DataConfig(_Section):
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
                raise _fail(f"data.{key}", value, "64 lowercase hex digits")
        if self.kind not in FILE_DATA and (self.val_fraction or self.val_path is not None):
            key = "val_fraction" if self.val_fraction else "val_path"
            allowed = 'unset: a validation split needs data.kind = "text" or "tokens"'
            raise _fail(f"data.{key}", getattr(self, key), allowed)
        if self.val_fraction and self.val_path is not None:
            raise _fail("data.val_fraction", self.val_fraction, "unset when data.val_path is set")


@dataclass(frozen=True)
class TrainingConfig(_Section):
    """`[training]`: the step protocol's sizes, the seed and the numeric type."""

    section: ClassVar[str] = "training"
    stages: int = _f(check=GE1)  #: pipeline stages (count; at most model.n_layers + 2)
    microbatch_size: int = _f(check=GE1)  #: samples per microbatch (the unit of routing)
    target_batch_size: int = _f(check=GE1)  #: samples per optimizer step
    steps: int = _f(check=GE1)  #: optimizer steps to run (count)
    seed: int = _f(0, GE0)  #: seeds parameters and the (seed, step, index) -> data mapping
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"  #: parameter and compute type
    #: "fp32": compute in `dtype`; "bf16-mixed": float32 parameters, optimizer state and
    #: gradient sums, bfloat16 autocast compute, bf16 on the wire unless [compression] says
    precision: Literal["fp32", "bf16-mixed"] = "fp32"
    # Not 0 by default: without a checkpoint a lost stage sends the whole job back to step 0.
    checkpoint_every: int = _f(100, GE0)  #: steps between checkpoints (0 = never)
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

    @property
    def microbatches_per_step(self) -> int:
        """M = target_batch_size / microbatch_size (count)."""
        return self.target_batch_size // self.microbatch_size

    def _validate(self) -> None:
        if self.target_batch_size % self.microbatch_size:
            allowed = f"a multiple of training.microbatch_size = {self.microbatch_size}"
            raise _fail("training.target_batch_size", self.target_batch_size, allowed)
        if self.precision == "bf16-mixed" and self.dtype != "float32":
            allowed = '"float32" when training.precision = "bf16-mixed" (the master weights)'
            raise _fail("training.dtype", self.dtype, allowed)


@dataclass(frozen=True)
class OptimizerConfig(_Section):
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
            raise _fail("optimizer.min_lr", self.min_lr, f"at most optimizer.lr = {self.lr}")


Codec = Literal["none", "fp16", "bf16", "int8_blockwise", "hadamard3"]


@dataclass(frozen=True)
class CompressionConfig(_Section):
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
class RebalanceConfig(_Section):
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
        for name in ("period_s", "hysteresis", "min_dwell_s", "move_cost_s", "horizon_s"):
            value = getattr(self, name)
            if not math.isfinite(value):  # inf passes the range checks but breaks the arithmetic
                raise _fail(f"rebalance.{name}", value, "a finite number")
        if self.horizon_s <= self.move_cost_s:
            allowed = f"a number > rebalance.move_cost_s = {self.move_cost_s}"
            raise _fail("rebalance.horizon_s", self.horizon_s, allowed)


@dataclass(frozen=True)
class RuntimeConfig(_Section):
    """`[runtime]`: networking and concurrency; none of these change the maths."""

    section: ClassVar[str] = "runtime"
    max_in_flight: int = _f(8, GE1)  #: microbatches a trainer keeps in flight (count)
    #: "push": stages send activations and gradients straight to each other; "relay": the
    #: trainer carries every one (the first data plane; its link carries 3x a server's)
    data_plane: Literal["push", "relay"] = "push"
    max_queue: int = _f(64, GE1)  #: pushed microbatches a replica queues before it says busy
    rpc_timeout_s: float = _f(60.0, GT0)  #: deadline of each Forward/Backward call (seconds)
    commit_timeout_s: float = _f(120.0, GT0)  #: deadline of a step's commit/averaging (seconds)
    chunk_bytes: int = _f(4 * MiB, GE1)  #: messages larger than this are streamed in chunks (bytes)
    max_message_bytes: int = _f(64 * MiB, GE1)  #: gRPC max message size (bytes; > chunk_bytes)
    max_tensor_bytes: int = _f(1024 * MiB, GE1)  #: largest tensor a server accepts (bytes)
    activation_cache: int = _f(64, GE0)  #: microbatches whose activations a server keeps (count)
    averaging_timeout_s: float = _f(60.0, GT0)  #: a pool round waits this long for a replica (s)
    #: averaging rounds one step may fail (no commit between) before the job fails (count)
    max_commit_rounds: int = _f(10, GE1)
    lease_timeout_s: float = _f(60.0, GT0)  #: unreported leased microbatches go elsewhere (s)
    #: bytes of boundary tensors a trainer keeps to replay lost gradients without the pipeline
    boundary_cache_bytes: int = _f(256 * MiB, GE0)
    #: bytes of applied updates a replica keeps for peers copying it (a copy slower than this
    #: covers starts again)
    update_log_bytes: int = _f(4096 * MiB, GE1)

    def _validate(self) -> None:
        if self.max_message_bytes <= self.chunk_bytes:
            allowed = f"an integer > runtime.chunk_bytes = {self.chunk_bytes}"
            raise _fail("runtime.max_message_bytes", self.max_message_bytes, allowed)


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

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME_RE.fullmatch(self.name):
            allowed = 'a string of 1-64 letters, digits, ".", "_" or "-", starting alphanumeric'
            raise _fail("name", self.name, allowed)
        if self.training.stages > self.model.n_layers + 2:  # embedding + blocks + head
            allowed = f"an integer <= model.n_layers + 2 = {self.model.n_layers + 2}"
            raise _fail("training.stages", self.training.stages, allowed)
        if self.data.kind == "text" and self.model.vocab_size < 256:  # text tokens are bytes
            allowed = 'an integer >= 256 when data.kind = "text"'
            raise _fail("model.vocab_size", self.model.vocab_size, allowed)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every key (paths as strings, tuples as lists)."""
        return json.loads(json.dumps(asdict(self), default=str))  # type: ignore[no-any-return]

    def fingerprint(self) -> str:
        """First 16 hex of sha256 over what changes the maths; runtime and data paths are left out
        (a moved data file keeps its fingerprint, an edited one does not). checkpoint_every is left
        out too: when checkpoints are written does not change the parameters."""
        d = self.to_dict()
        data: dict[str, Any] = {"kind": self.data.kind}
        if self.data.kind in FILE_DATA:
            data["sha256"] = self.data.sha256 or data_sha256(self)
        for key in ("checkpoint_every", "eval_every", "eval_microbatches"):
            d["training"].pop(key)  # when and how much is evaluated changes no parameter
        if self.data.val_fraction:  # the held-out tail is not trained on
            data["val_fraction"] = self.data.val_fraction
        if self.model.init_from is not None:  # the weights count, not where they lie
            d["model"]["init_from"] = None
            d["model"]["init_sha256"] = self.model.init_sha256 or init_sha256(self.model)
        # Keys added since the first release count only when used: a job without them keeps
        # its fingerprint, and a peer too old to apply them is refused for a job with them.
        for section, key in _LATER_KEYS:
            if d[section][key] == _DEFAULTS[section, key]:
                del d[section][key]
        keep = {k: d[k] for k in ("model", "training", "optimizer", "compression")}
        canon = json.dumps({**keep, "data": data}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]


_LATER_KEYS = (
    ("model", "init_from"),
    ("model", "init_sha256"),
    ("model", "n_kv_heads"),
    ("model", "mlp_hidden"),
    ("model", "rope_theta"),
    ("model", "norm_eps"),
    ("training", "grad_clip"),
    ("training", "precision"),
    ("training", "delayed_update"),
    ("optimizer", "schedule"),
    ("optimizer", "warmup_steps"),
    ("optimizer", "min_lr"),
    ("compression", "error_feedback"),
)
_DEFAULTS = {
    (section, key): getattr(cls, key)  # a dataclass field's default is its class attribute
    for section, key in _LATER_KEYS
    for cls in (ModelConfig, TrainingConfig, OptimizerConfig, CompressionConfig)
    if cls.section == section
}


def data_sha256(job: JobConfig, key: str = "path") -> str:
    """Hex sha256 of the data file (`data.<key>`: the training file, or `val_path`), checked:
    exists, longer than one sample, and UTF-8 (text) or whole token ids (tokens). Read in chunks,
    so a large file costs time (call it off an event loop) but not its size in memory."""
    path, need, text = getattr(job.data, key), job.model.seq_len + 1, job.data.kind == "text"
    width = 1 if text else token_width(job.model.vocab_size)
    allowed = (
        f"a UTF-8 text file longer than model.seq_len + 1 = {need} bytes"
        if text
        else f"a token file (`swarm prepare-data`) of more than model.seq_len + 1 = {need} "
        f"{8 * width}-bit ids (model.vocab_size = {job.model.vocab_size})"
    )
    problem, size, digest = "", 0, hashlib.sha256()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(str(path), "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                size += len(chunk)
                digest.update(chunk)
                if text:
                    utf8.decode(chunk)
            utf8.decode(b"", final=True)
    except OSError as e:
        problem = f"cannot be read ({e.strerror})"
    except UnicodeDecodeError as e:
        problem = f"is not UTF-8 ({e.reason})"
    if not problem and size % width:
        problem = f"has {size} bytes, not a whole number of {width}-byte ids"
    elif not problem and size // width <= need:
        problem = f"has {size} bytes"
    if problem:
        raise ConfigError(f"data.{key} = {_show(path)} {problem}; use {allowed}")
    return digest.hexdigest()


_HASH_CHUNK = 1 << 20


_INIT_HASHES: dict[tuple[str, int, int], str] = {}  # (path, size, mtime) -> sha256, per process


def init_sha256(model: ModelConfig) -> str:
    """Hex sha256 of `model.init_from`'s model.safetensors (remembered per file version: every
    stage built in a process asks, and a checkpoint can be gigabytes)."""
    assert model.init_from is not None
    path = Path(model.init_from) / "model.safetensors"
    try:
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key not in _INIT_HASHES:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(_HASH_CHUNK):
                    digest.update(chunk)
            _INIT_HASHES[key] = digest.hexdigest()
        return _INIT_HASHES[key]
    except OSError as e:
        raise ConfigError(
            f"model.init_from = {_show(model.init_from)}: cannot read {path.name} ({e.strerror}); "
            "use a Hugging Face checkpoint directory (`swarm export --format hf` writes one)"
        ) from None


def verify_init(job: JobConfig) -> JobConfig:
    """The job with `model.init_sha256` set to its checkpoint's hash; a job that pins another
    (the file changed since it was pinned) is refused with both named."""
    if job.model.init_from is None:
        return job
    digest = init_sha256(job.model)
    if job.model.init_sha256 not in (None, digest):
        raise ConfigError(
            f"model.init_sha256 = {_show(job.model.init_sha256)} is not the sha256 "
            f"{_show(digest)} of {_show(job.model.init_from)}/model.safetensors: the checkpoint "
            "changed since the job was pinned to it; restore it, or submit the job again"
        )
    return replace(job, model=replace(job.model, init_sha256=digest))


def verify_data(job: JobConfig) -> JobConfig:
    """Read a text job's data file (`job.data.path`, absolute) and return the job with
    `data.sha256` set to its hash. A job that pins another hash (a job file's `data.sha256`, or
    the one the scheduler wrote into the spec at submit) is refused with both hashes named: the
    file changed since. Reads the whole file: off the event loop in a server."""
    if job.data.kind not in FILE_DATA:
        return job
    pinned: dict[str, Any] = {}
    for path, key in (("path", "sha256"), ("val_path", "val_sha256")):
        if getattr(job.data, path) is None:
            continue
        digest, want = data_sha256(job, path), getattr(job.data, key)
        if want not in (None, digest):
            raise ConfigError(
                f"data.{key} = {_show(want)} is not the file's sha256 {_show(digest)} "
                f"(data.{path} = {_show(getattr(job.data, path))}): the data changed since the "
                "job was pinned to it (a scheduler pins it at submit); restore the file, or give "
                "the new hash (submit the job again)"
            )
        pinned[key] = digest
    return replace(job, data=replace(job.data, **pinned))


S = TypeVar("S", bound=_Section)


def _unknown(what: str, prefix: str, got: str, allowed: list[str]) -> ConfigError:
    close = difflib.get_close_matches(got, allowed, n=1)  # on bare names: the prefix is shared
    hint = f"did you mean {prefix}{close[0]}? " if close else ""
    names = ", ".join(prefix + a for a in allowed)
    return ConfigError(f"unknown {what} {prefix}{got}; {hint}allowed: {names}")


def _build(cls: type[S], table: Any) -> S:
    """Build a section from its TOML table: unknown and missing keys named, then `cls` checks."""
    if not isinstance(table, dict):
        raise _fail(cls.section, table, f"a [{cls.section}] table")
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    for key in table:
        if key not in names:
            raise _unknown("key", f"{cls.section}.", key, names)
    for f in fields(cls):  # type: ignore[arg-type]
        if f.default is MISSING and f.name not in table:
            allowed = _describe(_hints(cls)[f.name], f.metadata.get("check"))
            raise ConfigError(f"{cls.section}.{f.name} is required; use {allowed}")
    return cls(**table)


_CLASSES = (ModelConfig, DataConfig, TrainingConfig, OptimizerConfig, CompressionConfig)
SECTIONS: dict[str, type[_Section]] = {
    c.section: c for c in (*_CLASSES, RuntimeConfig, RebalanceConfig)
}


def _parse(text: str, base_dir: Path, name: str, source: str, check_data: bool = True) -> JobConfig:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: invalid TOML: {e}") from None
    for key in doc:
        if key != "name" and key not in SECTIONS:
            raise _unknown("section", "", key, ["name", *SECTIONS])
    if "name" not in doc and not NAME_RE.fullmatch(name):  # say where the bad name came from
        raise ConfigError(
            f"name is not set and the default {name!r} is not a valid job name; set "
            'name = "..." to 1-64 letters, digits, ".", "_" or "-"'
        )
    table = doc.get("compression", {})
    training = doc.get("training", {})
    if (
        isinstance(training, dict)
        and training.get("precision") == "bf16-mixed"
        and isinstance(table, dict)
        and not {"wire", "forward", "backward"} & table.keys()
    ):  # bf16 compute: bf16 on the wire too, unless the job says otherwise
        doc["compression"] = {**table, "wire": "bf16"}
    built = {s: _build(c, doc.get(s, {})) for s, c in SECTIONS.items()}
    job = JobConfig(name=doc.get("name", name), **built)  # type: ignore[arg-type]
    for key in ("path", "val_path"):
        path = getattr(job.data, key)
        if path is not None and not path.is_absolute():
            job = replace(job, data=replace(job.data, **{key: (base_dir / path).resolve()}))
    init = job.model.init_from
    if init is not None and not init.is_absolute():
        job = replace(job, model=replace(job.model, init_from=(base_dir / init).resolve()))
    if not check_data:
        return job
    return verify_init(verify_data(job))  # fail at load time, not when the first trainer starts


def parse_job(
    text: str, base_dir: Path, name: str = "job", *, check_data: bool = True
) -> JobConfig:
    """Parse job TOML; relative data paths resolve against `base_dir`; `name` is the default.
    `check_data=False` skips reading the data file: stage servers build the model from a job
    without ever reading its data, and may run where the file is not."""
    return _parse(text, Path(base_dir), name, f"<{name}>", check_data)


def load_job(path: str | Path) -> JobConfig:
    """Read and validate a job file; the job's name defaults to the file's stem."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"job file {str(path)!r} cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"job file {str(path)!r} is not UTF-8 ({e.reason})") from None
    return _parse(text, path.resolve().parent, path.stem, path.name)
