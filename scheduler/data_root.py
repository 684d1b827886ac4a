"""The scheduler's data root: the one directory whose files a submitted job may name as its data.
SubmitJob reads them and their bytes travel to the job's peers, so the root must hold nothing
else the scheduler keeps: over the job store, the checkpoints (every job's trained state) or a
TLS key, it would let any job ship them out. Never a default, then (the working directory held
all of those), and checked once, at start."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from swarm.errors import ConfigError

__all__ = ["check_data_root"]


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
