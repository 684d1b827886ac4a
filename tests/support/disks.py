"""A real full disk for tests: a tiny tmpfs mounted for the test (root only), and a filler file
that takes every free byte so the next write fails with ENOSPC."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["fill", "tiny_disk"]


@contextlib.contextmanager
def tiny_disk(path: Path, size: str = "256k", unmount: tuple[Path, ...] = ()) -> Iterator[Path]:
    """Mount a `size` tmpfs at `path` for the block; skips the test where mounting is refused.
    `unmount`: where the mount may be by the end instead (a directory above it renamed), looked
    at in turn (default: `path`)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        at = next((p for p in unmount or (path,) if os.path.ismount(p)), path)
        subprocess.run(["umount", "-l", str(at)], check=True)


def fill(directory: Path) -> Path:
    """Write a file in `directory` until its disk is full; returns it (delete it to free room)."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (65536, 4096, 512, 1):  # big writes first, then the last crumbs
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
        os.fsync(f.fileno())
    return filler
