"""`init_from`'s checkpoint is named by the sha256 of its manifest, each file's hash remembered
per file version so that every stage built in a process does not read gigabytes again. Whoever
may write the file can swap its bytes and set its size and mtime back as they were: that is
another version, and its hash is read anew (M9-hash)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from swarm.job.fingerprint import init_sha256
from swarm.job.manifest import Entry, digest
from swarm.job.schema import ModelConfig

pytestmark = pytest.mark.attack("M9-hash")

_MTIME_NS = 1_600_000_000_000_000_000  # a settled file's mtime, 2020


def _write(directory: Path, data: bytes) -> Path:
    """`data` as the checkpoint, with the same mtime every time (what `touch -d` makes)."""
    path = directory / "model.safetensors"
    path.write_bytes(data)
    os.utime(path, ns=(_MTIME_NS, _MTIME_NS))
    return path


def _named(data: bytes) -> str:
    """The pin of a checkpoint directory holding `data` as its one file."""
    return digest((Entry("model.safetensors", len(data), hashlib.sha256(data).hexdigest()),))


def _swapped(path: Path, data: bytes) -> None:
    before = path.stat()
    _write(path.parent, data)
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def test_a_swapped_file_of_the_same_size_and_mtime_is_hashed_anew(tmp_path: Path) -> None:
    a, b = b"A" * 4096, b"B" * 4096
    model = ModelConfig(init_from=tmp_path)
    path = _write(tmp_path, a)
    assert init_sha256(model) == _named(a)
    _swapped(path, b)
    assert init_sha256(model) == _named(b)


def test_a_remembered_hash_is_not_trusted_after_a_swap(tmp_path: Path) -> None:
    # A file settled long enough ago is remembered (read once); the swap still shows.
    a, b = b"a" * 4096, b"b" * 4096
    model = ModelConfig(init_from=tmp_path)
    path = _write(tmp_path, a)
    time.sleep(2.5)  # past the window in which a change may leave the kernel's stamp as it was
    assert init_sha256(model) == init_sha256(model) == _named(a)
    _swapped(path, b)
    assert init_sha256(model) == _named(b)
