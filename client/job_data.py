"""A remote trainer's copy of its job's data: at the path the job was submitted with when the file
is there (the scheduler's machine, a shared filesystem), else fetched from the scheduler (a
friend's machine, joined by an invite: no shared path). A fetched file is kept under the cache
directory by its sha256 (`<cache>/data/<sha256>`), the hash the scheduler pinned at submit, and
checked against it while it is written: a second trainer of the job, or of a job on the same
data, fetches nothing, and a file that does not match is never used."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

from swarm.errors import ConfigError
from swarm.job.config import JobConfig, verify_data
from swarm.job.schema import FILE_DATA

__all__ = ["Fetch", "local_data"]

log = logging.getLogger(__name__)

#: `fetch(validation)`: the job's data file (data.val_path with `validation`) in chunks.
Fetch = Callable[[bool], AsyncIterator[bytes]]


async def local_data(job: JobConfig, fetch: Fetch, cache: Path) -> JobConfig:
    """`job` (its data paths resolved, not checked) with every data file it names readable here
    and checked against its pinned sha256 (`verify_data`): at its path, else fetched."""
    if job.data.kind not in FILE_DATA:
        return job
    data = job.data
    for key, pin in (("path", "sha256"), ("val_path", "val_sha256")):
        path, digest = getattr(job.data, key), getattr(job.data, pin)
        if path is None or path.is_file() or digest is None:
            continue  # there (verify_data checks it), or nothing pinned to check a copy by
        kept = cache / "data" / digest
        if not kept.is_file():
            log.info("data.%s %s is not here: fetching it from the scheduler", key, path)
            await _fetch(fetch(key == "val_path"), kept, digest, f"data.{key}")
        data = replace(data, val_path=kept) if key == "val_path" else replace(data, path=kept)
    job = replace(job, data=data)
    return await asyncio.to_thread(verify_data, job)  # reads the file: off the event loop


async def _fetch(chunks: AsyncIterator[bytes], kept: Path, digest: str, what: str) -> None:
    """Write `chunks` to `kept` through a temporary file, renamed only once its sha256 is
    `digest`."""
    kept.parent.mkdir(parents=True, exist_ok=True)
    part = kept.with_name(f".{kept.name}.{os.getpid()}.partial")
    sha, size = hashlib.sha256(), 0
    try:
        with open(part, "wb") as f:
            async for chunk in chunks:
                sha.update(chunk)
                size += len(chunk)
                await asyncio.to_thread(f.write, chunk)
        if sha.hexdigest() != digest:
            raise ConfigError(
                f"{what} fetched from the scheduler has sha256 {sha.hexdigest()}, not the "
                f"{digest} pinned at submit: the file changed on the scheduler's machine since; "
                "submit the job again"
            )
        os.replace(part, kept)
        log.info("%s fetched: %d bytes, kept as %s", what, size, kept)
    finally:
        part.unlink(missing_ok=True)
