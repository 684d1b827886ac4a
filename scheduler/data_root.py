"""The scheduler's data root: the one directory whose files a submitted job may name as its data.
SubmitJob reads them and their bytes travel to the job's peers, so the root must hold nothing
else the scheduler keeps: over the job store, the checkpoints (every job's trained state) or a
TLS key, it would let any job ship them out. Never a default, then (the working directory held
all of those), and checked once, at start. A job names files under it only (`under_data_root`,
at submit); its data file is read from there again when a trainer fetches it (`data_file`: a
friend's trainer has no shared path), and so are the files of its starting checkpoint when a
stage server fetches them (`checkpoint_files`, `checkpoint_file`: a friend's has no shared path
either)."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import BinaryIO

from swarm.errors import (
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from swarm.job.config import JobConfig
from swarm.job.manifest import Entry, encode, manifest_of, path_problem
from swarm.job.schema import FILE_DATA

__all__ = [
    "check_data_root",
    "checkpoint_file",
    "checkpoint_files",
    "checkpoint_manifest",
    "chunks",
    "data_file",
    "opened",
    "under_data_root",
]


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


async def chunks(
    path: Path, offset: int, chunk_bytes: int, root: Path | None = None
) -> AsyncIterator[bytes]:
    """`path`'s bytes from `offset` on, `chunk_bytes` at a time (read off the loop: a slow
    disk); the file opened under `root`, when given (`opened`). Nothing from the end on."""
    with await asyncio.to_thread(opened, path, root) as f:
        if offset >= os.fstat(f.fileno()).st_size:
            # Nothing there, as a read past the end gives: the fetcher's own size check says a
            # file shrank since (`swarm.rpc.fetch_file`). Not sought: past 2^62 the seek itself
            # fails, the caller's number a bug's INTERNAL.
            return
        f.seek(offset)
        while data := await asyncio.to_thread(f.read, chunk_bytes):
            yield data


def opened(path: Path, root: Path | None) -> BinaryIO:
    """`path` opened to be read, and the file opened (not its name: a link swapped in after the
    name was resolved and checked is followed by the open) checked to lie under `root`, when
    given: PermissionDenied otherwise, the file closed. What the scheduler serves from the data
    root to any token holder must be what it checked. NotFound for a file gone since."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (returned open: its caller's `with`)
    except FileNotFoundError:  # the operator's to put back, not a bug's INTERNAL
        raise NotFound(
            f"{str(path)!r} is no longer on the scheduler's machine (moved or deleted since the "
            "job was submitted): nothing to serve"
        ) from None
    if root is None:
        return f
    real = Path(os.readlink(f"/proc/self/fd/{f.fileno()}"))  # the kernel's name of what opened
    if not real.is_relative_to(root):
        f.close()
        raise PermissionDenied(
            f"{str(path)!r} led outside the scheduler's data root {str(root)!r} as it was "
            "opened (a link put in its place): not served"
        )
    return f


# The longest path the system opens, with its NUL (Linux's PATH_MAX).
_PATH_MAX = os.pathconf("/", "PC_PATH_MAX") if hasattr(os, "pathconf") else 4096


def under_data_root(root: Path, path: Path, key: str) -> Path:
    """`path`'s real path (symlinks and `..` resolved), which must lie under `root` (resolved):
    a job may make the scheduler read only what it was told to serve. One longer than any path
    the system opens is refused first: `realpath` looks at each of its components (a submitted
    job's path of a megabyte held the event loop for each of 95,000)."""
    if len(os.fsencode(path)) >= _PATH_MAX:
        raise InvalidArgument(
            f"{key} is a path of {len(os.fsencode(path))} bytes, longer than any the system "
            f"opens ({_PATH_MAX})"
        )
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


def checkpoint_files(directory: Path, root: Path) -> tuple[Entry, ...]:
    """The manifest of the checkpoint `directory` (`swarm.job.manifest`), every file of which
    must lie under `root` with its links resolved: a link inside a checkpoint to a file elsewhere
    would have the scheduler read it, and send it to whoever fetches the checkpoint."""
    real = under_data_root(root, directory, "model.init_from")
    for top, _dirs, files in os.walk(real):
        for name in files:
            under_data_root(root, Path(top) / name, "a file of model.init_from")
    return manifest_of(real)


def checkpoint_file(job: JobConfig, path: str, root: Path) -> Path:
    """The file `path` of `job`'s checkpoint (a path its manifest names), under `root` again."""
    if job.model.init_from is None:
        raise FailedPrecondition(f"job {job.name!r} has no model.init_from: nothing to fetch")
    problem = path_problem(path)
    if problem is not None:
        raise InvalidArgument(f"{path!r} names no file of a checkpoint: {problem}")
    directory = under_data_root(root, job.model.init_from, "model.init_from")
    if path not in {e.path for e in checkpoint_files(directory, root)}:  # hashes remembered
        raise NotFound(f"model.init_from {job.model.init_from} has no file {path!r}")
    return under_data_root(root, directory / path, "a file of model.init_from")


def checkpoint_manifest(job: JobConfig, root: Path) -> bytes:
    """The manifest of `job`'s checkpoint, once its sha256 is still the pin: a checkpoint changed
    on this machine since the submit is not served (the fetcher would refuse it anyway)."""
    if job.model.init_from is None:
        raise FailedPrecondition(f"job {job.name!r} has no model.init_from: nothing to fetch")
    data = encode(checkpoint_files(job.model.init_from, root))
    if hashlib.sha256(data).hexdigest() != job.model.init_sha256:
        raise FailedPrecondition(
            f"model.init_from {job.model.init_from} changed on the scheduler's machine since the "
            f"job pinned it (model.init_sha256 = {job.model.init_sha256}): submit the job again"
        )
    return data
