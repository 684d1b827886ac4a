"""Where a replica keeps its gradient sums while the pool's sum overwrites them (docs/bulk.md,
"Memory").

A step's PREPARE averages the replica's gradient sums in place: each slice of the pool's sum
lands over the slice of the sums it was made from, so a commit holds the gradient once, not the
sums and the pool's total beside them (4 B a parameter less at a replica's peak). A retried
PREPARE (a member died mid-round: the survivors sum again without it) and a straggler's Backward
after PREPARE (it adds into a copy of the sums) still need the sums as they were. So before a
slice is overwritten, its values are written to a `Spill`: an unlinked file in the spill
directory (none is left behind, whatever kills the process), read back only when something needs
them. A file's pages are the kernel's: they sit in the page cache, which the kernel writes to
disk and reclaims when memory runs short. With no directory (`--spill-dir off`), or when a write
fails (a full disk), a slice's values are held in memory instead: nothing is lost, the replica's
peak is as before.

One file serves a replica's steps one after another (`SpillFile`, held by its `Sums`): a step's
spill writes over the pages an earlier step wrote, which the page cache still holds, instead of
a new file's. A new file's pages are allocated and charged page by page as the round writes
them, and freed when it closes: on shared cores that cost a step's round as much as the rest
of it (bench/bulk.py --rounds-only, docs/bulk.md). The price: while a replica commits, its file
stays dirty, so the kernel writes it back (`vm.dirty_expire_centisecs`: about every 30 s, at
most the gradient's bytes each time; a file made anew at every step never reached the disk
but under memory pressure). A file left free for half that time (a replica that stopped
committing) is closed, its pages dropped.

Thread-safety: `keep` runs in the event loop's threads as slices arrive while the replica's
worker may `restore` (a straggler); a slice is recorded kept only once its values are written,
and is overwritten only after, so a restore sees every overwritten slice among those kept.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import weakref
from pathlib import Path

import torch

from swarm.ops.private import private_dir
from swarm.ops.threads import name_this_thread
from swarm.wire.chunking import tensor_bytes

__all__ = [
    "IDLE_TIMER",
    "OFF",
    "Spill",
    "SpillFile",
    "dirty_expiry_s",
    "in_memory_fs",
    "spill_directory",
]

log = logging.getLogger(__name__)

OFF = "off"  # the spill directory that keeps the sums in memory

IDLE_TIMER = "spill-idle"
"""The OS name of a spill file's idle timer (`/proc/PID/task/*/comm`): a thread made as each
step gives the file back and ended as the next lends it, so present for part of every step once
a replica averages with another, one at most per file. Named, bench/soak.py tells it from a
leak (unnamed it read as "python", and a replica that began averaging late in a run, a second
replica joining its stage, grew by one thread)."""


class SpillFile:
    """An unlinked spill file that one spill after another writes (a replica's steps, one at a
    time): lent to a `Spill` at its first write, given back when it closes; closed, its pages
    dropped, once it is left free for `idle_s` (or with `close`, or when collected). What a
    spill reads back is only what it wrote itself: what an earlier one left in the file is
    never read. Once closed (its replica no longer served) none is kept: a spill still open
    then (a commit under way) has its file closed as it gives it back."""

    def __init__(self, idle_s: float | None = None) -> None:
        self.idle_s = dirty_expiry_s() / 2 if idle_s is None else idle_s
        self._lock = threading.Lock()
        self._free: tuple[Path, int] | None = None  # (its directory, its descriptor) while free
        self._timer: threading.Timer | None = None  # closes the free file when left idle
        self.opened = 0  # files made so far
        self.closed = False  # `close`d: a file given back is closed, not kept

    def lend(self, directory: Path) -> int:
        """The file, or a new one in `directory` when it is lent already or lies elsewhere."""
        with self._lock:
            free, self._free = self._free, None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        if free is not None:
            if free[0] == directory:
                return free[1]
            os.close(free[1])
        fd = _unlinked_file(directory)
        with self._lock:
            self.opened += 1
        return fd

    def give_back(self, directory: Path, fd: int) -> None:
        """`fd` (from `lend`) free again: kept for the next spill for `idle_s`, else (or when
        one is kept already) closed."""
        with self._lock:
            if self._free is None and self.idle_s > 0 and not self.closed:
                self._free, fd = (directory, fd), -1
                # A weak reference: a pending timer does not keep the file open past its
                # holder's life.
                self._timer = _IdleTimer(self.idle_s, _expire, (weakref.ref(self),))
                self._timer.daemon = True
                self._timer.start()
        if fd >= 0:
            os.close(fd)

    def _expire(self) -> None:
        """Left free for `idle_s`: the file goes (its pages dropped, unwritten when younger than
        the kernel's dirty expiry)."""
        with self._lock:
            free, self._free, self._timer = self._free, None, None
        if free is not None:
            os.close(free[1])

    def close(self) -> None:
        """The file goes now, and none is kept from now on (its replica is no longer served)."""
        with self._lock:
            self.closed = True
            free, self._free = self._free, None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        if free is not None:
            os.close(free[1])

    def __del__(self) -> None:
        timer, free = getattr(self, "_timer", None), getattr(self, "_free", None)
        if timer is not None:
            timer.cancel()
        if free is not None:
            os.close(free[1])


class _IdleTimer(threading.Timer):
    """A `threading.Timer` named `IDLE_TIMER` at the OS from its start (a thread's name there is
    its creator's until it names itself)."""

    def run(self) -> None:
        name_this_thread(IDLE_TIMER)
        super().run()


def _expire(file: weakref.ref[SpillFile]) -> None:
    held = file()
    if held is not None:
        held._expire()


def dirty_expiry_s() -> float:
    """How old dirty page cache may grow before the kernel writes it back (30 s by default)."""
    try:
        return int(Path("/proc/sys/vm/dirty_expire_centisecs").read_text()) / 100
    except (OSError, ValueError):
        return 30.0


class Spill:
    """The original values of the ranges of `flat` (1-D, contiguous) that averaging overwrites,
    in a file in `directory` (None: in memory), `reuse`'s when given (else one of its own). A
    device's `flat` (CUDA, averaged in place too) is kept on the host: each range copied over
    as it is kept (a slice's worth at a time), and copied back when restored; the device holds
    nothing more."""

    def __init__(
        self, flat: torch.Tensor, directory: Path | None, reuse: SpillFile | None = None
    ) -> None:
        if flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError("a spill keeps a 1-D contiguous tensor")
        self.flat, self._directory, self._reuse = flat, directory, reuse
        self._lock = threading.Lock()
        self._file: int | None = None  # the unlinked file's descriptor, made at the first keep
        self._disk = directory is not None  # False once a write failed: the rest in memory
        self._kept: list[slice] = []  # ranges of `flat` whose originals are in the file
        self._held: list[tuple[slice, torch.Tensor]] = []  # ... or in memory
        self.closed = False

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            spans = [*self._kept, *(where for where, _ in self._held)]
            return sum(w.stop - w.start for w in spans) * self.flat.element_size()

    def keep(self, where: slice) -> None:
        """Keep `flat[where]` as it is now, before it is overwritten (blocking: call it off the
        event loop). A spill closed meanwhile keeps nothing: no one needs those values."""
        with self._lock:
            if self.closed:
                return
            values, copied = self.flat[where], False
            if values.device.type != "cpu":  # a device's: written or held from a host copy
                values, copied = values.cpu(), True
            if self._disk and self._write(values, where.start * self.flat.element_size()):
                self._kept.append(where)
            else:
                self._held.append((where, values if copied else values.clone()))

    def restore(self, into: torch.Tensor | None = None) -> None:
        """Write the kept originals back into `flat` (then nothing is kept: the sums are whole
        again), or into `into`, a copy of `flat` made before this call (then the spill closes:
        the copy is the sums from now on)."""
        with self._lock:
            target = self.flat if into is None else into
            for where in self._kept:
                place = target[where]
                on_host = place.device.type == "cpu"
                host = place if on_host else torch.empty_like(place, device="cpu")
                self._read(host, where.start * self.flat.element_size())
                if host is not place:
                    place.copy_(host)
            for where, values in self._held:
                target[where].copy_(values)
            self._kept, self._held = [], []
            if into is not None:
                self._close()

    def close(self) -> None:
        """Drop what is kept (the step applied, or its sums were discarded)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        self.closed, self._kept, self._held = True, [], []
        if self._file is not None:
            fd, self._file = self._file, None
            if self._reuse is not None and self._directory is not None:
                self._reuse.give_back(self._directory, fd)  # its pages serve the next spill
            else:
                os.close(fd)

    def _write(self, values: torch.Tensor, offset: int) -> bool:
        """`values` into the file at `offset`; False (the disk given up on) when it fails."""
        try:
            if self._file is None:
                assert self._directory is not None
                self._file = (
                    _unlinked_file(self._directory)
                    if self._reuse is None
                    else self._reuse.lend(self._directory)
                )
            view, done = tensor_bytes(values), 0
            while done < len(view):
                done += os.pwrite(self._file, view[done:], offset + done)
            return True
        except OSError as e:
            self._disk = False
            log.warning(
                "could not write a step's gradient sums to the spill directory %s (%s): this "
                "step keeps them in memory, at the cost of a copy of the gradient",
                self._directory,
                e,
            )
            return False

    def _read(self, into: torch.Tensor, offset: int) -> None:
        assert self._file is not None
        view, done = tensor_bytes(into), 0
        while done < len(view):
            got = os.preadv(self._file, [view[done:]], offset + done)
            if got == 0:
                raise OSError(f"the spill file ended at {offset + done} bytes")
            done += got

    def __del__(self) -> None:
        if getattr(self, "_file", None) is not None:
            os.close(self._file)  # type: ignore[arg-type]


def _unlinked_file(directory: Path) -> int:
    """A new file in `directory` that has no name: it goes when its descriptor closes."""
    private_dir(directory)
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except (AttributeError, OSError):  # no O_TMPFILE here (or this filesystem lacks it)
        fd, name = tempfile.mkstemp(prefix="swarm-spill-", dir=directory)
        os.unlink(name)
        return fd


def spill_directory(setting: str) -> Path | None:
    """The spill directory `--spill-dir` names: "" the system's temp directory, `OFF` none (in
    memory). One in memory (tmpfs) saves no memory: said at start, where an operator looks."""
    if setting == OFF:
        return None
    directory = Path(setting or tempfile.gettempdir())
    kind = in_memory_fs(directory)
    if kind is not None:
        log.warning(
            "the spill directory %s is on %s, in memory: a commit's spilled gradient sums take "
            "memory there; give --spill-dir a directory on a disk",
            directory,
            kind,
        )
    return directory


def in_memory_fs(directory: Path) -> str | None:
    """The filesystem type when `directory` lies on one in memory (tmpfs, ramfs), else None:
    spilling there saves no memory."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    path, best, kind = str(directory.resolve()), -1, ""
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, kind = len(point), fields[2]
    return kind if kind in ("tmpfs", "ramfs") else None
