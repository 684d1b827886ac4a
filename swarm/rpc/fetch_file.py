"""One file fetched from the scheduler into a machine's cache, the mechanism both fetches share
(a job's data file, `FetchData`; each file of its starting checkpoint, `FetchInit`).

The bytes are written to `<kept>.partial` as they come and hashed on the way, never held whole:
a chunk at a time is all the memory a file of any size costs. A stream that breaks (the link
drops, the scheduler restarts) or ends short is asked again from the partial file's size, a
bounded number of times, each failure logged with its cause; so is a fetch a killed process left
half done, continued by the next one. The file is renamed to `kept` only once its size and sha256
are the pinned ones; one that is not is refused with both hashes named, and its partial removed.
Callers fetching into one cache at once take `cache_lock` first."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from swarm.deadline import within
from swarm.errors import ConfigError, PeerUnavailable
from swarm.ops.durable import fsync_path
from swarm.ops.file_locks import taken_now
from swarm.policy.backoff import Backoff

__all__ = [
    "FETCH_ATTEMPTS",
    "LOCK_STALL_S",
    "STALL_S",
    "Source",
    "cache_lock",
    "durably_renamed",
    "fetch_file",
]

log = logging.getLogger(__name__)

#: `source(offset)`: the file's bytes from `offset` on, in chunks.
Source = Callable[[int], AsyncIterator[bytes]]
#: How many times one file's stream is asked for before the fetch gives up.
FETCH_ATTEMPTS = 8
#: Seconds a stream may send nothing between two chunks before it is given up and asked again
#: from where it stopped. A link gone silent with no reset (a home router's NAT entry dropped)
#: would otherwise hold the fetch for its stream's whole deadline (an hour:
#: `swarm.rpc.init_fetch`). The wait for the first chunk is that deadline's alone.
STALL_S = 120.0
#: Seconds between a fetch lock's heartbeats: its holder stamps the lock file while it holds it,
#: however slowly its fetch goes (the scheduler may hash a whole checkpoint, for up to an hour,
#: before a stream's first byte).
LOCK_BEAT_S = 30.0
#: Seconds a held fetch lock may go without a heartbeat before a process waiting for it gives up:
#: its holder is stopped or hung (a live one, however slow, stamps it every `LOCK_BEAT_S`).
LOCK_STALL_S = 300.0
_LOCK_POLL_S = 0.25
_READ_CHUNK = 1 << 20


class _Short(Exception):
    """The stream ended before the file's size, or sent nothing for its stall bound: asked
    again from where it stopped."""


async def fetch_file(
    source: Source,
    kept: Path,
    *,
    sha256: str,
    size: int | None = None,
    max_size: int | None = None,
    what: str,
    attempts: int = FETCH_ATTEMPTS,
    backoff: Backoff | None = None,
    stall_s: float = STALL_S,
) -> None:
    """The file `source` serves, kept at `kept` once its sha256 is `sha256` (and its size `size`,
    when known; at most `max_size` bytes, when bounded). ConfigError for a file that does not
    match (its partial removed); the source's last error once `attempts` streams broke (or
    sent nothing for `stall_s`)."""
    backoff = backoff or Backoff(first_s=0.5, cap_s=10.0)
    limit = size if size is not None else max_size
    part = await asyncio.to_thread(_resume, kept.with_name(kept.name + ".partial"), limit, what)
    for attempt in range(1, attempts + 1):
        try:
            await _append(source, part, limit, what, stall_s)
            if size is not None and part.size < size:
                raise _Short(f"the stream ended at {part.size} of {size} bytes")
            break
        except (PeerUnavailable, _Short) as e:
            if attempt == attempts:
                log.error(
                    "%s: fetch failed %d times, the last at byte %d: %s",
                    what,
                    attempts,
                    part.size,
                    e,
                )
                raise
            delay = backoff.next()
            log.warning(
                "%s: fetch broke at byte %d (%s); going on from there in %.1f s (try %d of %d)",
                what,
                part.size,
                e,
                delay,
                attempt + 1,
                attempts,
            )
            await asyncio.sleep(delay)
    got = part.sha.hexdigest()
    if got != sha256 or (size is not None and part.size != size):
        part.path.unlink(missing_ok=True)
        sized = f", {part.size} bytes, not {size}" if size is not None and part.size != size else ""
        raise ConfigError(
            f"{what} fetched from the scheduler has sha256 {got}{sized}, not the {sha256} pinned "
            "at submit: refused and removed (the file changed on the scheduler's machine since, "
            "or the bytes were damaged on the way); submit the job again"
        )
    await asyncio.to_thread(durably_renamed, part.path, kept)
    log.info("%s fetched: %d bytes, kept as %s", what, part.size, kept)


def durably_renamed(done: Path, kept: Path) -> None:
    """`done` (a file, or a directory of them, whose bytes are whole) renamed to `kept`, on disk
    before it takes the name: a file under its final name is taken as whole by its size alone at
    a later start (`swarm.rpc.init_fetch`), and one renamed before its bytes reached the disk
    can be left its size and no bytes by a power cut. Its bytes are synced (a directory's files
    were, each as it was kept), then it is renamed, then the directory that names it is."""
    if done.is_file():
        fsync_path(done)
    os.replace(done, kept)
    fsync_path(kept.parent)


@dataclass
class _Partial:
    """The partial file, the hash of what it holds, and its size: what a next stream goes on
    from. Updated chunk by chunk, so a stream that breaks leaves it true."""

    path: Path
    sha: hashlib._Hash
    size: int


def _resume(path: Path, limit: int | None, what: str) -> _Partial:
    """What `path` already holds (a fetch broken off in an earlier process), hashed, to go on
    from; a partial longer than the file may be is started again."""
    part = _Partial(path, hashlib.sha256(), 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        have = path.stat().st_size
    except FileNotFoundError:
        return part
    if limit is not None and have > limit:
        log.warning("%s: %s holds %d bytes, over %d: fetching it anew", what, path, have, limit)
        path.unlink()
        return part
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            part.sha.update(chunk)
            part.size += len(chunk)
    log.info("%s: going on from byte %d of %s", what, part.size, path)
    return part


async def _append(
    source: Source, part: _Partial, limit: int | None, what: str, stall_s: float
) -> None:
    """Append what `source(part.size)` streams to the partial file, hashing it. Every chunk is on
    the disk before the next is asked for, so `part` always says what the file holds."""
    stream = aiter(source(part.size))
    # The first chunk's wait is the stream's own deadline's: the scheduler hashes a whole
    # checkpoint before a file's first byte (100 GB outlast any stall bound). Between chunks,
    # a link gone silent is given up after `stall_s`.
    bound: float | None = None
    try:
        with open(part.path, "ab") as f:
            while True:
                try:
                    chunk = await within(anext(stream), bound)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise _Short(f"nothing came for {stall_s:g} s") from None
                bound = stall_s
                await _keep(f, chunk, part, limit, what)
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:  # the stream's call ends with it, not left to the collector
            await close()


async def _keep(f: BinaryIO, chunk: bytes, part: _Partial, limit: int | None, what: str) -> None:
    """`chunk` on the disk and in `part`'s hash; refused (the partial removed) past `limit`."""
    if limit is not None and part.size + len(chunk) > limit:
        part.path.unlink(missing_ok=True)
        raise ConfigError(
            f"{what} from the scheduler is longer than the {limit} bytes it may have: "
            "refused and removed"
        )
    await asyncio.to_thread(_write, f, chunk)
    part.sha.update(chunk)
    part.size += len(chunk)


def _write(f: BinaryIO, chunk: bytes) -> None:
    f.write(chunk)
    f.flush()


@contextlib.asynccontextmanager
async def cache_lock(path: Path, kept: Path, stall_s: float = LOCK_STALL_S) -> AsyncIterator[None]:
    """Hold `path` (a lock file) exclusively while `kept` is fetched: two processes of one
    machine (or two tasks of one) fetching the same thing wait for each other, and the second
    finds it fetched. Released with the descriptor, even if the process dies. Polled, so a
    cancel ends the wait with nothing left blocked; the wait is said once, and given up, naming
    the lock, once its holder's heartbeat (the lock file's time, stamped every `LOCK_BEAT_S`
    while held) has not moved for `stall_s`: the holder is stopped or hung, not slow."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        await _locked(fd, path, kept, stall_s)
        os.utime(fd)  # its first heartbeat, before any waiter could read an old time
        beating = asyncio.create_task(_beat(fd), name=f"heartbeat of {path.name}")
        try:
            yield
        finally:
            beating.cancel()
            await asyncio.wait({beating})  # a cancel of this task itself is not swallowed
    finally:
        os.close(fd)


async def _locked(fd: int, path: Path, kept: Path, stall_s: float) -> None:
    """Take the lock on `fd`, waiting while its holder's heartbeat moves. The heartbeat is read
    as it changes on this process's own clock, never against the wall clock: a lock file's time
    is a day old under a removal of a stale partial (which beats not), or just before a new
    holder's first stamp, and a laptop's sleep moves the wall clock past any stamp."""
    loop = asyncio.get_running_loop()
    stamp, since = -1, loop.time()
    while not taken_now(fd):
        if stamp < 0:
            log.warning(
                "another process of this machine is fetching %s (it holds %s): waiting for it",
                kept,
                path,
            )
        now_stamp = os.fstat(fd).st_mtime_ns
        if now_stamp != stamp:
            stamp, since = now_stamp, loop.time()
        elif loop.time() - since > stall_s:
            raise ConfigError(
                f"another process of this machine holds {path} fetching {kept}, and its "
                f"heartbeat has not come for {stall_s:.0f} s: is it stopped or hung? Stop it "
                "(its fetch goes on from its partial files at the next start)"
            )
        await asyncio.sleep(_LOCK_POLL_S)


async def _beat(fd: int) -> None:
    """Stamp the held lock file every `LOCK_BEAT_S`: the waiters' sign of life. A stamp that
    fails (a file system gone read-only) is said and ends the heartbeat, not the fetch."""
    while True:
        await asyncio.sleep(LOCK_BEAT_S)
        try:
            os.utime(fd)
        except OSError as e:
            log.warning("the fetch lock's heartbeat stopped (%s): waiters may give up", e)
            return
