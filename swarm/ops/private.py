"""Files only their owner may read, whatever the umask: the job store, the checkpoints, the spill
files and the keys hold a job's data and a swarm's secrets. `private_dir` creates missing
directories 0700, `private_open` is an `opener=` that creates files 0600 (a umask can only take
bits away, so neither is ever wider)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DIR_MODE", "FILE_MODE", "private_dir", "private_open"]

FILE_MODE = 0o600
DIR_MODE = 0o700


def private_dir(path: Path) -> None:
    """Create `path` and its missing parents, each 0700 (`Path.mkdir(parents=True)` gives the
    parents the umask's mode); existing directories are left as they are."""
    missing = []
    for p in (path, *path.parents):
        if p.is_dir():
            break
        missing.append(p)
    for p in reversed(missing):
        try:
            os.mkdir(p, DIR_MODE)
        except FileExistsError:
            if not p.is_dir():
                raise


def private_open(path: str, flags: int) -> int:
    """`open(path, mode, opener=private_open)`: a file it creates is 0600."""
    return os.open(path, flags, FILE_MODE)
