"""A checkpoint directory named by one digest: its manifest, the sorted list of its files as
(relative path, size, sha256), whose own sha256 is what a job pins (`model.init_sha256`).

Why a manifest: a starting checkpoint (`[model] init_from`) is a directory (`model.safetensors`,
`config.json`, perhaps more), and a machine without it fetches it from the scheduler file by file
(`swarm.rpc.init_fetch`). One digest over the manifest covers every file, the config as much as the
weights, and the manifest tells the fetcher each file's size and hash before any byte of it comes,
so every file is checked as it is written and a broken fetch goes on from what is already there.

The format is canonical JSON, one object: `{"files": [[path, size, sha256], ...]}`, sorted by
path, no spaces, ASCII. Paths are POSIX, relative, with no `.`, `..` or empty part: a manifest
that names any other is refused (`path_problem`), so a fetched manifest can write only inside the
directory it is fetched into. A file's hash is remembered per version of the file (`file_sha256`):
every stage built in a process asks for the digest, and a checkpoint can be gigabytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from swarm.errors import ConfigError

__all__ = [
    "MAX_FILES",
    "MAX_MANIFEST_BYTES",
    "Entry",
    "digest",
    "encode",
    "file_sha256",
    "manifest_of",
    "parse",
    "path_problem",
]

#: The most files a checkpoint's manifest may list, and the most bytes the manifest may have:
#: a fetcher reads it whole, so a hostile one must not size the fetcher's memory.
MAX_FILES = 10_000
MAX_MANIFEST_BYTES = 4 << 20
_HEX = re.compile(r"[0-9a-f]{64}")
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True, order=True)
class Entry:
    """One file of a checkpoint directory: its path relative to it (POSIX), size, sha256."""

    path: str
    size: int
    sha256: str


def path_problem(path: str) -> str | None:
    """Why `path` may not name a file of a checkpoint directory (None: it may): it must be
    relative, POSIX, and have no `.`, `..` or empty part, so it lies inside the directory."""
    if not path:
        return "it is empty"
    if "\\" in path or "\0" in path:
        return "it holds a backslash or a NUL"
    if path.startswith("/"):
        return "it is absolute"
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "it has an empty, '.' or '..' part"
    return None


def manifest_of(directory: Path) -> tuple[Entry, ...]:
    """The manifest of `directory`: every regular file under it (a link to a file counts as the
    file it names: a Hugging Face cache's snapshot links to its blobs), sorted by path. Anything
    else (a link to a directory, a socket) is refused: a fetcher could not make it again."""
    entries: list[Entry] = []
    for top, dirs, files in os.walk(directory):
        for name in sorted(dirs):
            if os.path.islink(os.path.join(top, name)):
                raise ConfigError(
                    f"model.init_from = {directory}: {os.path.join(top, name)} is a link to a "
                    "directory; a checkpoint directory holds files and directories only"
                )
        for name in files:
            path = Path(top) / name
            if not path.is_file():
                raise ConfigError(
                    f"model.init_from = {directory}: {path} is not a regular file; a checkpoint "
                    "directory holds files and directories only"
                )
            if len(entries) == MAX_FILES:  # before it is hashed: a fetcher takes no more
                raise ConfigError(
                    f"model.init_from = {directory} holds more than {MAX_FILES} files (swarm's "
                    "MAX_FILES), the most a fetcher takes from a checkpoint's manifest"
                )
            rel = PurePosixPath(path.relative_to(directory)).as_posix()
            entries.append(Entry(rel, path.stat().st_size, file_sha256(path)))
    return tuple(sorted(entries))


def encode(entries: tuple[Entry, ...]) -> bytes:
    """The manifest's canonical bytes (the pin is their sha256)."""
    rows = [[e.path, e.size, e.sha256] for e in sorted(entries)]
    return json.dumps({"files": rows}, separators=(",", ":"), ensure_ascii=True).encode()


def digest(entries: tuple[Entry, ...]) -> str:
    """Hex sha256 of the manifest: the checkpoint's pin."""
    return hashlib.sha256(encode(entries)).hexdigest()


def parse(data: bytes, pinned: str) -> tuple[Entry, ...]:
    """The manifest `data` says, once its sha256 is `pinned` and it is well formed: sizes and
    hashes, and paths that stay inside the directory (`path_problem`), sorted, each once, none
    both a file and a directory. ConfigError says what is wrong."""
    got = hashlib.sha256(data).hexdigest()
    if got != pinned:
        raise ConfigError(
            f"the checkpoint's manifest has sha256 {got}, not the model.init_sha256 = {pinned} "
            "pinned at submit: the checkpoint changed on the scheduler's machine since; submit "
            "the job again"
        )
    try:
        rows = json.loads(data)["files"]
        entries = tuple(Entry(str(p), int(s), str(h)) for p, s, h in rows)
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"the checkpoint's manifest is not a manifest ({error})") from None
    if len(entries) > MAX_FILES:
        raise ConfigError(f"the checkpoint's manifest lists {len(entries)} files, over {MAX_FILES}")
    for e in entries:
        problem = path_problem(e.path)
        if problem is not None:
            raise ConfigError(f"the checkpoint's manifest names {e.path!r}: refused, {problem}")
        if e.size < 0 or not _HEX.fullmatch(e.sha256):
            raise ConfigError(f"the checkpoint's manifest has a bad size or sha256 for {e.path!r}")
    paths = [e.path for e in entries]
    if paths != sorted(set(paths)):
        raise ConfigError("the checkpoint's manifest is not sorted, or names a file twice")
    files = set(paths)
    for path in paths:
        for folder in PurePosixPath(path).parents:
            if str(folder) in files:
                raise ConfigError(
                    f"the checkpoint's manifest names {folder} as a file and a folder"
                )
    return entries


# File versions remembered: more than a checkpoint holds (`MAX_FILES`), so that a walk of the
# largest one comes back to each of its files still remembered (with 256, a checkpoint of 300
# files was hashed whole at every FetchInit); about 200 bytes each.
_MAX_HASHES = 2 * MAX_FILES


# A file's version -> its sha256, per process: (path, device, inode, size, mtime, ctime), all in
# ns. Size and mtime alone are no version: whoever may write the file can swap its bytes and set
# its mtime back (`touch -d`). ctime is the kernel's own stamp of any change to the file, which no
# user can set, and a file renamed over it is another inode. The least recently asked is
# forgotten first. Threads ask at once (the job API hashes off its loop): under `_LOCK`, with
# the versions being hashed (`_HASHING`) that the others wait for rather than hash again.
_Version = tuple[str, int, int, int, int, int]
_HASHES: OrderedDict[_Version, str] = OrderedDict()
_HASHING: dict[_Version, threading.Event] = {}
_LOCK = threading.Lock()
# A file changed this recently may change again within the same tick of the (coarse) clock that
# stamps ctime, leaving the stamp as it was: such a file is hashed every time, not remembered.
_RACY_NS = 2_000_000_000


def _version(path: Path) -> _Version:
    st = path.stat()
    return (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def file_sha256(path: Path) -> str:
    """Hex sha256 of the file at `path`, read in chunks (a large file costs time, never its size
    in memory), remembered per file version: any change to the file, even one that keeps its
    size and mtime, is a new version. A version another thread is hashing is waited for, not
    hashed again. OSError if it cannot be read."""
    before, started = _version(path), time.time_ns()
    while True:
        with _LOCK:
            known = _HASHES.get(before)
            if known is not None:
                _HASHES.move_to_end(before)
                return known
            other = _HASHING.get(before)
            if other is None:
                _HASHING[before] = threading.Event()
                break
        other.wait()  # then remembered (or not: a racy version, hashed here too)
        if before not in _HASHES:
            return _hashed(path, before, started, ours=False)
    try:
        return _hashed(path, before, started, ours=True)
    finally:
        with _LOCK:
            _HASHING.pop(before).set()


def _hashed(path: Path, before: _Version, started: int, *, ours: bool) -> str:
    """`path`'s sha256, read now; remembered (`ours`: as the one thread hashing `before`) for a
    version that held still while it was read, and was settled before: else the next call
    reads it again."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            sha.update(chunk)
    if ours and _version(path) == before and before[-1] < started - _RACY_NS:
        with _LOCK:
            _HASHES[before] = sha.hexdigest()
            while len(_HASHES) > _MAX_HASHES:
                _HASHES.popitem(last=False)
    return sha.hexdigest()
