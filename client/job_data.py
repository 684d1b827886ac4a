"""A remote trainer's copy of its job's data: at the path the job was submitted with when the file
is there (the scheduler's machine, a shared filesystem), else fetched from the scheduler (a
friend's machine, joined by an invite: no shared path). A fetched file is kept under the cache
directory by its sha256 (`<cache>/data/<sha256>`), the hash the scheduler pinned at submit, and
checked against it while it is written (`swarm.rpc.fetch_file`, as each file of a starting
checkpoint is: streamed, resumed from its partial file on a broken stream): a second trainer of
the job, or of a job on the same data, fetches nothing, and a file that does not match is never
used. The trainer holds each fetched file (`swarm.rpc.cache_room.hold`) for its run: nothing
making room on the machine removes it meanwhile."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

from swarm.job.config import JobConfig, verify_data
from swarm.job.schema import FILE_DATA
from swarm.rpc.cache_room import Uses, holding, tidy
from swarm.rpc.fetch_file import Source, cache_lock, fetch_file

__all__ = ["Fetch", "local_data"]

log = logging.getLogger(__name__)

#: `fetch(validation, offset)`: the job's data file (data.val_path with `validation`) in chunks,
#: from byte `offset` on.
Fetch = Callable[[bool, int], AsyncIterator[bytes]]


async def local_data(
    job: JobConfig, fetch: Fetch, cache: Path, uses: Uses, holder: str
) -> JobConfig:
    """`job` (its data paths resolved, not checked) with every data file it names readable here
    and checked against its pinned sha256 (`verify_data`): at its path, else fetched, and held
    by `holder` in `uses` (until `uses.release(holder)`)."""
    if job.data.kind not in FILE_DATA:
        return job
    data, locks = job.data, cache / "locks"
    for key, pin in (("path", "sha256"), ("val_path", "val_sha256")):
        path, digest = getattr(job.data, key), getattr(job.data, pin)
        if path is None or path.is_file() or digest is None:
            continue  # there (verify_data checks it), or nothing pinned to check a copy by
        kept = cache / "data" / digest
        async with holding(uses, holder, locks, "data", digest):
            if not kept.is_file():
                async with cache_lock(locks / f"data-{digest}", kept):
                    if not kept.is_file():  # not fetched by the one this waited for
                        log.info(
                            "data.%s %s is not here: fetching it from the scheduler", key, path
                        )
                        source = _source(fetch, key == "val_path")
                        await fetch_file(source, kept, sha256=digest, what=f"data.{key}")
        # other files' fetches a job's end cut short go, and those nobody used for a week
        # (`swarm.rpc.cache_room`)
        await asyncio.to_thread(tidy, cache, "data", digest)
        data = replace(data, val_path=kept) if key == "val_path" else replace(data, path=kept)
    job = replace(job, data=data)
    return await asyncio.to_thread(verify_data, job)  # reads the file: off the event loop


def _source(fetch: Fetch, validation: bool) -> Source:
    def source(offset: int) -> AsyncIterator[bytes]:
        return fetch(validation, offset)

    return source
