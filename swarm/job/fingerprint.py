"""A job's identity: the fingerprint over what changes its maths, and the sha256 of the files it
names (data, validation data, initial checkpoint).

Why: every role builds the job from its own copy of the spec, so a peer, a trainer or a restarted
scheduler must be able to tell that it trains the same maths as the others. The fingerprint leaves
out what does not change the parameters (runtime settings, where files lie, when checkpoints and
evaluations happen) and names file contents by hash, not path. Invariant: keys added since the
first release count only when set off their default, so a job without them keeps its fingerprint
and a peer too old to apply one is refused for a job that sets it. Files are hashed in chunks: a
large file costs time (hash it off an event loop), never its size in memory.
"""

from __future__ import annotations

import codecs
import hashlib
import json
from pathlib import Path
from typing import Any

from swarm.errors import ConfigError
from swarm.job.coerce import show
from swarm.job.manifest import digest, manifest_of
from swarm.job.schema import (
    FILE_DATA,
    CompressionConfig,
    JobConfig,
    ModelConfig,
    OptimizerConfig,
    TrainingConfig,
    token_width,
)

__all__ = ["data_sha256", "fingerprint", "init_sha256"]


def fingerprint(job: JobConfig) -> str:
    """First 16 hex of sha256 over what changes the maths; runtime and data paths are left out
    (a moved data file keeps its fingerprint, an edited one does not). checkpoint_every is left
    out too: when checkpoints are written does not change the parameters."""
    d = job.to_dict()
    data: dict[str, Any] = {"kind": job.data.kind}
    if job.data.kind in FILE_DATA:
        data["sha256"] = job.data.sha256 or data_sha256(job)
    for key in ("checkpoint_every", "keep_checkpoints", "eval_every", "eval_microbatches"):
        d["training"].pop(key)  # when and how much is evaluated changes no parameter
    if job.data.val_fraction:  # the held-out tail is not trained on
        data["val_fraction"] = job.data.val_fraction
    if job.model.init_from is not None:  # the weights count, not where they lie
        d["model"]["init_from"] = None
        d["model"]["init_sha256"] = job.model.init_sha256 or init_sha256(job.model)
    # Keys added since the first release count only when used: a job without them keeps
    # its fingerprint, and a peer too old to apply them is refused for a job with them.
    for section, key in _LATER_KEYS:
        if d[section][key] == _DEFAULTS[section, key]:
            del d[section][key]
    keep = {k: d[k] for k in ("model", "training", "optimizer", "compression")}
    # the pool's rule changes the maths; the default keeps old prints
    if job.pool.mode != "step" or job.pool.overlap != "none":
        keep["pool"] = d["pool"]
    canon = json.dumps({**keep, "data": data}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


_LATER_KEYS = (
    ("model", "init_from"),
    ("model", "init_sha256"),
    ("model", "n_kv_heads"),
    ("model", "mlp_hidden"),
    ("model", "rope_theta"),
    ("model", "norm_eps"),
    ("model", "boundary_rank"),
    ("model", "boundary_table"),
    ("model", "boundary_bottleneck"),
    ("training", "grad_clip"),
    ("training", "precision"),
    ("training", "delayed_update"),
    ("training", "tf32"),
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
        raise ConfigError(f"data.{key} = {show(path)} {problem}; use {allowed}")
    return digest.hexdigest()


_HASH_CHUNK = 1 << 20


def init_sha256(model: ModelConfig) -> str:
    """Hex sha256 of `model.init_from`'s manifest (`swarm.job.manifest`): every file of the
    checkpoint directory, its config as much as its weights, each file's hash remembered per
    version (every stage built in a process asks, and a checkpoint can be gigabytes)."""
    assert model.init_from is not None
    weights = Path(model.init_from) / "model.safetensors"
    try:
        weights.stat()  # the file every checkpoint has: its absence is said by name
        return digest(manifest_of(Path(model.init_from)))
    except OSError as e:
        raise ConfigError(
            f"model.init_from = {show(model.init_from)}: cannot read "
            f"{Path(e.filename or weights).name} ({e.strerror}); "
            "use a Hugging Face checkpoint directory (`swarm export --format hf` writes one)"
        ) from None
