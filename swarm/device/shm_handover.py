"""The handover of CPU tensors (`swarm.device.handover`) through POSIX shared memory: a file of
`/dev/shm` per payload, written and read with one `pwritev`/`preadv` each (no mapping to tear
down, nothing the other side can touch after its call: the reader copies into a tensor of its
own). Named `swarm-ho-PIDNS-PID-RANDOM`: 128 random bits, so no one guesses another's, and its
creator's process, so `sweep` knows the segments whose creator is dead (a SIGKILLed server)
and removes them; every process that makes a handover sweeps once at its start.

Why not `multiprocessing.shared_memory`: its resource tracker unlinks a segment when any process
that opened it exits (Python before 3.13), and a reader is not its owner here. Why not torch's
`share_memory_()` (file_system strategy): its segments live until torch's shm manager sees every
user gone, and it hands them over as pickles."""

from __future__ import annotations

import functools
import os
import re
import secrets
from pathlib import Path
from stat import S_ISREG

import torch

from swarm.device.offer import Offer
from swarm.device.site import SHM_DIR
from swarm.errors import InvalidArgument
from swarm.proto import tensor_pb2
from swarm.wire.chunking import tensor_bytes

__all__ = ["PREFIX", "SharedMemoryHandover", "sweep"]

PREFIX = "swarm-ho-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-(\d+)-[0-9a-f]{{32}}$")


class SharedMemoryHandover:
    kind = "shm"

    def __init__(self, directory: Path = SHM_DIR) -> None:
        self.directory = directory
        _swept(directory)

    def offer(self, payload: torch.Tensor) -> Offer:
        offer = self.slot(payload.numel())
        try:
            with _opened(self._path(offer.handle), os.O_WRONLY) as fd:
                _write(fd, payload)
        except BaseException:  # /dev/shm full, say: what it wrote would hold it till we exit
            offer.release()
            raise
        return offer

    def slot(self, nbytes: int) -> Offer:
        name = f"{PREFIX}{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(16)}"
        path = self.directory / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        except BaseException:
            _unlink(path)
            raise
        finally:
            os.close(fd)
        handle = tensor_pb2.Handover(shm=name)
        return Offer(
            handle,
            nbytes,
            read=lambda: self.take(handle, nbytes),
            release=functools.partial(_unlink, path),
        )

    def take(self, handle: tensor_pb2.Handover, nbytes: int) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8)
        with _opened(self._path(handle), os.O_RDONLY, nbytes) as fd:
            view, done = tensor_bytes(out), 0
            while done < nbytes:
                n = os.preadv(fd, [view[done:]], done)
                if n <= 0:
                    raise InvalidArgument(f"handover {handle.shm}: ended at {done} of {nbytes}")
                done += n
        return out

    def fill(self, handle: tensor_pb2.Handover, payload: torch.Tensor) -> bool:
        try:
            with _opened(self._path(handle), os.O_WRONLY, payload.numel()) as fd:
                _write(fd, payload)
        except (OSError, InvalidArgument):
            return False
        return True

    def _path(self, handle: tensor_pb2.Handover) -> Path:
        # A name from another process: only ours, and only in our directory.
        if not _NAME.match(handle.shm):
            raise InvalidArgument(f"not a handover segment: {handle.shm[:80]!r}")
        return self.directory / handle.shm


class _opened:
    """An open segment, its size checked against `nbytes` (None: not checked)."""

    def __init__(self, path: Path, flags: int, nbytes: int | None = None) -> None:
        self.path, self.flags, self.nbytes = path, flags, nbytes

    def __enter__(self) -> int:
        # Non-blocking: a FIFO of a segment's name (any local process may make one) blocks its
        # open until another end opens, on the event loop (a take) or the worker (a fill). A
        # regular file's reads and writes never block on the flag; it is cleared anyway.
        try:
            self.fd = os.open(self.path, self.flags | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            raise InvalidArgument(f"handover {self.path.name}: {e.strerror}") from None
        stat = os.fstat(self.fd)
        if not S_ISREG(stat.st_mode):
            os.close(self.fd)
            raise InvalidArgument(f"handover {self.path.name}: not a regular file")
        os.set_blocking(self.fd, True)
        if self.nbytes is not None and stat.st_size != self.nbytes:
            os.close(self.fd)
            raise InvalidArgument(
                f"handover {self.path.name}: {stat.st_size} bytes, not {self.nbytes}"
            )
        return self.fd

    def __exit__(self, *_: object) -> None:
        os.close(self.fd)


def _write(fd: int, payload: torch.Tensor) -> None:
    view, done = tensor_bytes(payload.contiguous()), 0
    while done < len(view):
        done += os.pwritev(fd, [view[done:]], done)


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


@functools.cache
def _pid_namespace() -> str:
    try:
        return re.sub(r"\D", "", os.readlink("/proc/self/ns/pid")) or "0"
    except OSError:
        return "0"


@functools.cache
def _swept(directory: Path) -> None:
    sweep(directory)


def sweep(directory: Path = SHM_DIR) -> list[str]:
    """Remove the segments of `directory` whose creator (in this PID namespace) is dead: what a
    SIGKILLed process left. The names removed."""
    removed, ns = [], _pid_namespace()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        m = _NAME.match(name)
        if m is None or m.group(1) != ns or _alive(int(m.group(2))):
            continue
        _unlink(directory / name)
        removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's: alive
    return True
