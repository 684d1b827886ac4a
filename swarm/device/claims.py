"""Who else computes on this device: a registry on the host, one file per claimant, so the stage
servers sharing one GPU size their activation windows together (`swarm.device.sharing`).

Why files and locks: the servers on one card are separate processes, started in any order and
killed in any way, with nothing between them but the host. Each claimant keeps one small file
under a folder named by the device's host-wide identity (its UUID: two processes with different
`CUDA_VISIBLE_DEVICES` name one card differently by index), holding the bytes its window keeps
now, and holds an exclusive `flock` on it for its life. The kernel drops that lock when the
process dies, SIGKILL included, so a file no one holds locked is a dead claimant's: whoever reads
the registry next removes it (`Claim.others`), and until then it is not counted. No PID is
trusted (one may be reused), and no one needs to stop cleanly.

A claim is made under the folder's own lock (`.lock`), created under a temporary name, locked,
then renamed into place, so a reader never sees a claim that is not locked yet. The folders live
in /dev/shm (memory, gone with a reboot, shared by the containers that share the host's IPC, as
co-located servers' CUDA handover needs anyway), else the system's temporary folder; they are
open to every user of the host (sticky, like /tmp), since servers of several users may share a
card, and so are the files in them, whatever the maker's umask (`_readable_by_all`). A claim
another user left behind is not counted once dead, though not theirs to remove.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
import struct
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from swarm.ops.rated import RatedLog

__all__ = ["CLAIMS_DIR", "Claim", "Claims"]

log = logging.getLogger(__name__)
# A claim that cannot be read is read again at every look (each activation a window keeps):
# said once an hour for each, not at every microbatch. One left by a dead claimant of another
# user stays (its sticky folder lets only that user remove it) and is counted until a reboot.
_unread = RatedLog(log, every_s=3600.0)

_SHM = Path("/dev/shm")
CLAIMS_DIR = (_SHM if _SHM.is_dir() else Path(tempfile.gettempdir())) / "swarm-device-claims"
_HELD = struct.Struct("<q")  # a claim's content: the bytes its window keeps now
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_SUFFIX = ".claim"


class Claims:
    """The registry of the devices of this host, under `root` (tests give a folder of their own)."""

    def __init__(self, root: Path = CLAIMS_DIR) -> None:
        self.root = root

    def claim(self, device: str) -> Claim:
        """A claim on `device` (its host-wide identity) for this process, until `close`."""
        folder = self.root / _SAFE.sub("_", device)
        _open_folder(self.root)
        _open_folder(folder)
        return Claim(folder)


class Claim:
    """One claimant's file in a device's folder: the bytes its window holds (`publish`), and
    what the others' hold (`others`)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        name = f"{os.getpid()}-{secrets.token_hex(6)}"
        self.path = folder / f"{name}{_SUFFIX}"
        with _folder_lock(folder):
            staged = folder / f".{name}.tmp"
            fd = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _readable_by_all(fd)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.pwrite(fd, _HELD.pack(0), 0)
                os.rename(staged, self.path)
            except BaseException:
                os.close(fd)
                _unlink(staged)
                raise
        self._fd: int | None = fd
        # The worker thread publishes as it keeps an entry while the event loop may close the
        # claim: a write after the close would land in whatever file took the descriptor's number.
        self._lock = threading.Lock()

    def publish(self, held: int) -> None:
        """Say that this claimant's window holds `held` bytes now (one 8-byte write, in place)."""
        with self._lock:
            if self._fd is None:
                return
            try:
                os.pwrite(self._fd, _HELD.pack(max(0, held)), 0)
            except OSError as e:  # the others then count what it said last: sizing, not safety
                log.warning("device claim %s: cannot say what it holds (%s)", self.path.name, e)

    def others(self) -> list[int]:
        """The bytes each other live claimant on this device holds; the dead ones' files removed."""
        held, dead = [], []
        for path in self._claims():
            if path == self.path:
                continue
            found = _read_live(path)
            if found is None:
                dead.append(path)
            else:
                held.append(found)
        if dead:
            self._sweep(dead)
        return held

    def close(self) -> None:
        """Withdraw the claim (the lock goes with the descriptor; the file with the unlink)."""
        with self._lock:
            if self._fd is None:
                return
            _unlink(self.path)
            os.close(self._fd)
            self._fd = None

    def _claims(self) -> Iterator[Path]:
        for name in _names(self.folder):
            if name.endswith(_SUFFIX):
                yield self.folder / name

    def _sweep(self, dead: list[Path]) -> None:
        # Under the folder's lock, so a claim being made is never taken for a dead one; each is
        # checked again there (the first look was without the lock).
        with _folder_lock(self.folder):
            for path in dead:
                if _read_live(path) is None and _unlink(path):
                    log.info("device claim %s: its process is gone; removed", path.name)
            for name in _names(self.folder):
                if name.endswith(".tmp"):  # a claimant killed while making its claim
                    _unlink(self.folder / name)


def _names(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError as e:
        log.warning("device claims in %s unreadable (%s): others not counted", folder, e)
        return []


def _read_live(path: Path) -> int | None:
    """The bytes a claim says, or None when its claimant is dead (nobody holds its lock) or it is
    gone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as e:  # another user's, made before claims were opened to all: alive
        _unread.warning(
            path.name, "device claim %s: unreadable (%s): counted, as holding nothing", path.name, e
        )
        return 0
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                _unread.warning(
                    path.name, "device claim %s: cannot tell if alive (%s): counted", path.name, e
                )
                return 0
            data = os.pread(fd, _HELD.size, 0)
            return _HELD.unpack(data)[0] if len(data) == _HELD.size else 0
        return None  # the lock was free: its holder is dead
    finally:
        os.close(fd)


@contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    # Read-only is enough to lock, and lets one user lock the file another made.
    fd = os.open(folder / ".lock", os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        _readable_by_all(fd)
        fcntl.flock(fd, fcntl.LOCK_EX)  # held for a create or a sweep: microseconds
        yield
    finally:
        os.close(fd)


def _open_folder(folder: Path) -> None:
    try:
        folder.mkdir(mode=0o777, exist_ok=True)
        os.chmod(folder, 0o1777)  # every user's servers may share a card; sticky, like /tmp
    except PermissionError:
        pass  # another user's folder, made open by them


def _readable_by_all(fd: int) -> None:
    """Open a file this process made to the other users of the card, whatever its umask (077
    kept the folder's lock and a claim to their maker: another user's server could neither make
    its claim nor count this one). Another user's file is left as its maker set it."""
    with suppress(PermissionError):
        os.fchmod(fd, 0o644)


def _unlink(path: Path) -> bool:
    """Remove `path`; whether it went (another user's, in the sticky folder, stays)."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except PermissionError:
        log.debug("device claim %s is another user's: left", path.name)
        return False
    return True
