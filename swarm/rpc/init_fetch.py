"""A job's starting checkpoint (`[model] init_from`) on a machine that lacks the directory: fetched
from the scheduler (`FetchInit`), file by file, into `<cache>/init/<sha256>/`, named by the
manifest digest the scheduler pinned at submit (`model.init_sha256`, `swarm.job.manifest`).

A stage server loads its stage's slice of the checkpoint (a trainer loads none: it keeps the pin),
so on a friend's machine, joined by an invite and sharing no path with the scheduler, it would have
nothing to load. The manifest comes first and is checked against the pin; it names each file's
size and sha256, and each is fetched by `swarm.rpc.fetch_file` (streamed, checked, resumable). The
files gather in `<sha256>.partial/` and the directory is renamed into place only when all are
there: a directory under its final name is whole. A second stage server of the machine (or of a
job on the same checkpoint) waits on the lock and fetches nothing. The caller holds the directory
(`swarm.rpc.cache_room.hold`) from before it is looked for until it lets the job go: nothing
makes room by removing it meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import grpc

from swarm.errors import ConfigError
from swarm.job.config import JobConfig
from swarm.job.manifest import MAX_MANIFEST_BYTES, parse
from swarm.net import dial
from swarm.net.invite import cache_dir
from swarm.proto import scheduler_pb2 as spb
from swarm.proto import scheduler_pb2_grpc
from swarm.rpc.cache_room import Uses, holding, make_room, tidy
from swarm.rpc.fetch_file import Source, cache_lock, durably_renamed, fetch_file
from swarm.rpc.status import from_rpc_error
from swarm.wire.chunking import grpc_options

__all__ = ["InitFetch", "InitSource", "is_local", "local_init", "scheduler_init"]

log = logging.getLogger(__name__)

#: `fetch(path, offset)`: a file of the job's checkpoint ("" for its manifest) from `offset` on.
InitFetch = Callable[[str, int], AsyncIterator[bytes]]
#: `source(job_id, job)`: `job` with its checkpoint on this machine (`scheduler_init`).
InitSource = Callable[[str, JobConfig], Awaitable[JobConfig]]
#: The largest message the fetch takes: the scheduler's chunk (4 MiB of data by default, a few
#: bytes over gRPC's own 4 MiB limit) with room, as a remote trainer's channel to it has.
MAX_MESSAGE_BYTES = 64 << 20
#: Seconds one stream may take in all (a home link: 1 GB at 20 Mbit/s is 400 s).
STREAM_TIMEOUT_S = 3600.0


def is_local(job: JobConfig) -> bool:
    """Whether `job`'s checkpoint directory is at its path here (then it is read there, and its
    contents are checked against the pin when loaded)."""
    init = job.model.init_from
    return init is None or (Path(init) / "model.safetensors").is_file()


async def local_init(
    job: JobConfig, fetch: InitFetch, cache: Path, uses: Uses, holder: str
) -> JobConfig:
    """`job` with `model.init_from` a directory on this machine: its own path when the checkpoint
    is there, else `<cache>/init/<sha256>/`, fetched once and held by `holder` in `uses` (until
    `uses.release(holder)`)."""
    if is_local(job):
        return job
    pin = job.model.init_sha256
    if pin is None:
        raise ConfigError(
            f"model.init_from = {job.model.init_from} is not on this machine, and the job pins no "
            "model.init_sha256 to fetch it by (a job submitted before checkpoints were served)"
        )
    kept, locks = cache / "init" / pin, cache / "locks"
    async with holding(uses, holder, locks, "init", pin):
        if not kept.is_dir():
            async with cache_lock(locks / f"init-{pin}", kept):
                if not kept.is_dir():  # not fetched by the one this waited for
                    log.info(
                        "model.init_from %s is not here: fetching it from the scheduler",
                        job.model.init_from,
                    )
                    await _fetch_directory(fetch, kept, pin, locks)
    # other checkpoints' fetches a job's end cut short go, and those nobody used for a week
    # (`swarm.rpc.cache_room`)
    await asyncio.to_thread(tidy, cache, "init", pin)
    return replace(job, model=replace(job.model, init_from=kept))


async def _fetch_directory(fetch: InitFetch, kept: Path, pin: str, locks: Path) -> None:
    staging = kept.with_name(f"{kept.name}.partial")
    manifest = kept.with_name(f"{kept.name}.manifest")
    if not manifest.is_file():
        await fetch_file(
            _source(fetch, ""),
            manifest,
            sha256=pin,
            max_size=MAX_MANIFEST_BYTES,
            what="the checkpoint's manifest",
        )
    entries = parse(await asyncio.to_thread(manifest.read_bytes), pin)
    staging.mkdir(parents=True, exist_ok=True)
    # room for what is left to fetch: checkpoints nobody holds go, least recently used first;
    # refused, with why, where that leaves too little
    need = sum(max(0, e.size - _have(staging / e.path)) for e in entries)
    await asyncio.to_thread(make_room, kept.parent, locks, "init", pin, need)
    root = staging.resolve()
    for entry in entries:
        target = staging / entry.path
        if root not in target.resolve().parents:  # parse refused it already: never written
            raise ConfigError(f"the checkpoint's manifest names {entry.path!r}: outside it")
        if target.is_file() and target.stat().st_size == entry.size:
            continue  # fetched and checked before a restart: renamed into place only then
        target.parent.mkdir(parents=True, exist_ok=True)
        await fetch_file(
            _source(fetch, entry.path),
            target,
            sha256=entry.sha256,
            size=entry.size,
            what=f"model.init_from's {entry.path}",
        )
    await asyncio.to_thread(durably_renamed, staging, kept)  # each file synced as fetched
    manifest.unlink()  # the directory is whole under its name: nothing left to go on from
    log.info("model.init_from fetched: %d files, kept as %s", len(entries), kept)


def _have(path: Path) -> int:
    """Bytes of a file fetched before a restart, whole or in part (`fetch_file` goes on from
    its partial): what its fetch will not take again."""
    have = 0
    for each in (path, path.with_name(f"{path.name}.partial")):
        with contextlib.suppress(FileNotFoundError):
            have = max(have, each.stat().st_size)
    return have


def _source(fetch: InitFetch, path: str) -> Source:
    def source(offset: int) -> AsyncIterator[bytes]:
        return fetch(path, offset)

    return source


def scheduler_init(address: str, token: str | None, uses: Uses) -> InitSource:
    """`local_init` of a job (its id, its config) of the scheduler at `address`, dialled with
    `token` (and the process's TLS), kept in this machine's cache (`SWARM_CACHE_DIR`) and held
    in `uses` by the job's id."""

    async def local(job_id: str, job: JobConfig) -> JobConfig:
        if is_local(job):
            return job
        channel = dial.channel(address, token=token, options=grpc_options(MAX_MESSAGE_BYTES))
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)

        async def fetch(path: str, offset: int) -> AsyncIterator[bytes]:
            request = spb.SchedulerFetchInitRequest(job=job_id, path=path, offset=offset)
            try:
                async for part in stub.FetchInit(request, timeout=STREAM_TIMEOUT_S):
                    yield part.data
            except grpc.RpcError as e:
                raise from_rpc_error(e) from e

        try:
            return await local_init(job, fetch, cache_dir(), uses, job_id)
        finally:
            await channel.close()

    return local
