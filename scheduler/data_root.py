"""The scheduler's data root: the one directory whose files a submitted job may name as its data.
SubmitJob reads them and their bytes travel to the job's peers, so the root must hold nothing
else the scheduler keeps: over the job store, the checkpoints (every job's trained state) or a
TLS key, it would let any job ship them out. Never a default, then (the working directory held
all of those), and checked once, at start. A job names files under it only (`under_data_root`,
at submit); its data file is read from there again when a trainer fetches it (`data_file`: a
friend's trainer has no shared path)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from swarm.errors import ConfigError, FailedPrecondition, InvalidArgument
from swarm.job.config import JobConfig
from swarm.job.schema import FILE_DATA

__all__ = ["check_data_root", "data_file", "under_data_root"]


def check_data_root(root: Path | None, kept: Mapping[str, Path | None]) -> Path:
    """`root` with symlinks resolved, checked against `kept`: what the scheduler keeps, by the
    flag that names it (`{"--store": Path("jobs.sqlite"), ...}`; None: not kept). A ConfigError
    names the conflict when the root is not given or not a directory, holds one of `kept`, or
    lies inside one (a root inside the checkpoint directory)."""
    if root is None:
        raise ConfigError(
            "the scheduler needs --data-root DIR (SWARM_DATA_ROOT): the one directory whose files "
            "a submitted job may name as its data; give one that holds job data only"
        )
    real = Path(os.path.realpath(root))
    if not real.is_dir():
        raise ConfigError(f"--data-root {str(root)!r} is not a directory")
    for flag, path in kept.items():
        if path is None:
            continue
        other = Path(os.path.realpath(path))
        if other.is_relative_to(real) or real.is_relative_to(other):
            where = "holds" if other.is_relative_to(real) else "lies inside"
            raise ConfigError(
                f"--data-root {str(root)!r} {where} {flag} {str(path)!r}: a job could name it "
                "as its data and its bytes would travel to the job's peers; give --data-root a "
                f"directory that holds job data only, or move {flag} out of it"
            )
    return real


def under_data_root(root: Path, path: Path, key: str) -> Path:
    """`path`'s real path (symlinks and `..` resolved), which must lie under `root` (resolved):
    a job may make the scheduler read only what it was told to serve."""
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(root):
        raise InvalidArgument(
            f"{key} = {str(path)!r} lies outside the scheduler's data root {str(root)!r}; put "
            "the data under it, or start the scheduler with --data-root naming a directory that "
            "holds it"
        )
    return real


def data_file(job: JobConfig, validation: bool, root: Path) -> Path:
    """The file a trainer fetches of `job` (its paths resolved): data.path, or data.val_path
    with `validation`; under `root` again (it was at submit, but a symlink may have moved)."""
    key = "val_path" if validation else "path"
    path = getattr(job.data, key)
    if job.data.kind not in FILE_DATA or path is None:
        raise FailedPrecondition(f"job {job.name!r} has no data.{key}: nothing to fetch")
    return under_data_root(root, path, f"data.{key}")
