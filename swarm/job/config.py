"""Job files read: TOML text parsed into a checked `JobConfig` (`load_job`, `parse_job`), the paths
it names resolved against the job file's directory, and those files checked against the hashes
the job pins (`verify_data`, `verify_init`).

Every check raises one `ConfigError` naming the full key (`training.dtype`), the bad value and what
is allowed, so a user can fix a job file from the message alone. Files are checked at load time,
not when the first trainer starts; `check_data=False` is for roles that never read the data (stage
servers build the model from a job and may run where the file is not).

The job's pieces live beside this file, one concept each: the dataclasses in `swarm.job.schema`,
the coercion engine in `swarm.job.coerce`, fingerprints and file hashes in `swarm.job.fingerprint`.
The names other modules have always imported from here are re-exported (`__all__`), so
`from swarm.job.config import JobConfig` keeps working.
"""

from __future__ import annotations

import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

from swarm.errors import ConfigError
from swarm.job.coerce import build_section, show, unknown_name
from swarm.job.fingerprint import data_sha256, init_sha256
from swarm.job.key_depth import check_key_depth
from swarm.job.schema import (
    FILE_DATA,
    MAX_SPEC_BYTES,
    NAME_RE,
    SECTIONS,
    CompressionConfig,
    DataConfig,
    JobConfig,
    ModelConfig,
    OptimizerConfig,
    PoolConfig,
    RebalanceConfig,
    RuntimeConfig,
    TrainingConfig,
    token_width,
)

__all__ = [
    "FILE_DATA",
    "CompressionConfig",
    "DataConfig",
    "JobConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PoolConfig",
    "RebalanceConfig",
    "RuntimeConfig",
    "TrainingConfig",
    "check_spec_size",
    "data_sha256",
    "init_sha256",
    "load_job",
    "parse_job",
    "token_width",
    "verify_data",
    "verify_init",
]


def verify_init(job: JobConfig) -> JobConfig:
    """The job with `model.init_sha256` set to its checkpoint's hash; a job that pins another
    (the file changed since it was pinned) is refused with both named."""
    if job.model.init_from is None:
        return job
    digest = init_sha256(job.model)
    if job.model.init_sha256 not in (None, digest):
        raise ConfigError(
            f"model.init_sha256 = {show(job.model.init_sha256)} is not the sha256 "
            f"{show(digest)} of {show(job.model.init_from)}'s files (their manifest): the "
            "checkpoint changed since the job was pinned to it; restore it, or submit the job again"
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
                f"data.{key} = {show(want)} is not the file's sha256 {show(digest)} "
                f"(data.{path} = {show(getattr(job.data, path))}): the data changed since the "
                "job was pinned to it (a scheduler pins it at submit); restore the file, or give "
                "the new hash (submit the job again)"
            )
        pinned[key] = digest
    return replace(job, data=replace(job.data, **pinned))


def check_spec_size(text: str, source: str = "the job file") -> None:
    """Refuse a job file over MAX_SPEC_BYTES: the scheduler stores it, announces it to every
    peer and hands it to every trainer, so its size is everyone's."""
    size = len(text.encode())
    if size > MAX_SPEC_BYTES:
        raise ConfigError(
            f"{source} is {size} bytes, over the {MAX_SPEC_BYTES} bytes (1 MiB, swarm's "
            "MAX_SPEC_BYTES) a job file may have; keep data in a file named by data.path"
        )


def _parse(text: str, base_dir: Path, name: str, source: str, check_data: bool = True) -> JobConfig:
    check_spec_size(text, source)
    check_key_depth(text, source)  # before the parser, whose time on deep keys is quadratic
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: invalid TOML: {e}") from None
    except RecursionError:  # arrays or inline tables nested past the parser's stack
        raise ConfigError(f"{source}: invalid TOML: values nested too deeply") from None
    for key in doc:
        if key != "name" and key not in SECTIONS:
            raise unknown_name("section", "", key, ["name", *SECTIONS])
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
    built = {s: build_section(c, doc.get(s, {})) for s, c in SECTIONS.items()}
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
