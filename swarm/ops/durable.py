"""A file's or a directory's bytes on disk (`fsync_path`): what a name is made to point at only
once its bytes are there (a checkpoint's files, a fetched file), and the directory that names it
after the rename, so that a power cut leaves the old name or the whole new file, never a name
with no bytes behind it."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_path"]


def fsync_path(path: Path) -> None:
    """Sync `path` (a file or a directory) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
