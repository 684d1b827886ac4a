"""The checkpoint format: `<dir>/step-<N>/stage-<k>.safetensors` holds stage k's state at step N in
the stage-state format (`swarm.model.stage_state`); `manifest.json`, written last and atomically,
marks the checkpoint complete and records the data position (the step: data is a function of
`(seed, step, index)`). Checkpoints written before this format (`stage-<k>.pt`, `torch.save`) are
still read.

A stage file is a safetensors file written as its tensors come (`StageWriter`): a stage's state
is never held whole to be written (the coordinator streams a replica's download into it), each
tensor's bytes go from its own memory to the file, and one fsync ends it. The header, which
safetensors puts before the data, is written last into room kept for it (padded with spaces, as
the format allows); a header larger than that room is rare (thousands of tensors) and costs one
copy of the file, not a failure.

Every file is written to a temporary name, fsynced, renamed, and its directory fsynced, so a
crash leaves a whole file or none. A write that fails (a full disk) removes its partial file and
raises `CheckpointError`."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import logging
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors.torch import load_file

from swarm.ops.durable import fsync_path
from swarm.ops.private import private_dir, private_open

__all__ = [
    "CheckpointError",
    "StageWriter",
    "discard",
    "latest",
    "load_model",
    "load_stage",
    "prune",
    "save_file",
    "save_stage",
    "seal",
    "sealed",
    "sweep",
]


class CheckpointError(OSError):
    """A checkpoint file could not be written (a full or broken disk). An `OSError`, so that
    callers which skip a checkpoint on a disk error catch it whatever the writer raised."""


log = logging.getLogger(__name__)


def _dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _tmp_name(path: Path) -> Path:
    """Where `path` is written before it is renamed into place (this process's own)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _atomic(path: Path, write: Callable[[BinaryIO], object], what: str) -> None:
    """`write(f)` writes the file; it becomes `path` once it is on disk."""
    tmp = _tmp_name(path)
    try:
        private_dir(path.parent)
        with open(tmp, "wb", opener=private_open) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        tmp.replace(path)
        fsync_path(path.parent)  # and the rename too
    except Exception as e:  # torch.save turns ENOSPC into RuntimeError
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise CheckpointError(f"{what}: cannot write {path} ({e})") from e


def save_stage(root: Path, step: int, stage: int, state: dict[str, torch.Tensor]) -> None:
    """Write stage `stage`'s state at `step`; a state holding a NaN or infinite value is refused
    (`CheckpointError`) before a byte is written: the last sealed checkpoint stays the one a
    rollback uses, rather than one that would poison every replica that loads it."""
    for name, tensor in state.items():
        _check_finite(step, stage, name, tensor)
    writer = StageWriter(root, step, stage, tensors=len(state))
    try:
        for name, tensor in state.items():
            writer.add(name, tensor, checked=True)
        writer.close()
    except BaseException:
        writer.abort()
        raise


# safetensors' names of the dtypes a stage's state holds
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_HEADER_ROOM = 4096  # bytes kept for the header, and this much more a tensor expected
_HEADER_ROOM_PER_TENSOR = 256
_WRITE_BACK_BYTES = 1 << 20  # a tensor at least this large starts its write-back at once
_HEADER_ROOM_UNKNOWN = 64 << 10  # when no count is known: the header of a few hundred tensors


class StageWriter:
    """Stage `stage`'s checkpoint file of `step`, written tensor by tensor (`add`) and made whole
    by `close`, or removed by `abort`. `tensors`: how many are expected (0: not known), for the
    header's room.
    Not thread-safe: one writer, one caller at a time (a thread of its own is fine)."""

    def __init__(self, root: Path, step: int, stage: int, tensors: int = 0) -> None:
        self.step, self.stage = step, stage
        self.path = _dir(root, step) / f"stage-{stage}.safetensors"
        self._tmp = _tmp_name(self.path)
        self._what = f"checkpoint of step {step}, stage {stage}"
        room = _HEADER_ROOM + _HEADER_ROOM_PER_TENSOR * tensors if tensors else _HEADER_ROOM_UNKNOWN
        self._room = room + (-room % 8)  # the data starts 8-byte aligned
        self._entries: dict[str, dict[str, object]] = {}
        self._size = 0  # data bytes written
        self._file: BinaryIO | None = None  # opened by the first write: no I/O here
        self._done = False  # closed or aborted

    def _opened(self) -> BinaryIO:
        if self._done:
            raise CheckpointError(f"{self._what}: written to after it was closed or aborted")
        if self._file is None:
            try:
                private_dir(self.path.parent)
                self._file = open(self._tmp, "wb", opener=private_open)  # noqa: SIM115 (closed by close or abort)
                self._file.seek(self._room)
            except OSError as e:
                self.abort()
                raise CheckpointError(f"{self._what}: cannot write {self.path} ({e})") from e
        return self._file

    def add(self, name: str, tensor: torch.Tensor, checked: bool = False) -> None:
        """Append `tensor` as `name`; one holding a NaN or infinite value is refused
        (`CheckpointError`; `abort` the writer then), unless the caller `checked` it."""
        file = self._opened()
        if name in self._entries:
            raise CheckpointError(f"{self._what}: {name} twice")
        if tensor.dtype not in _DTYPES:
            raise CheckpointError(f"{self._what}: {name} is {tensor.dtype}, not a state's dtype")
        if not checked:
            _check_finite(self.step, self.stage, name, tensor)
        # Its own memory, as bytes (reshape first: a 0-dim tensor has no byte view).
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        try:
            file.write(data.data)  # a memoryview of its bytes: no copy
            _write_back(file, self._room + self._size, data.nbytes)
        except OSError as e:
            raise CheckpointError(f"{self._what}: cannot write {self.path} ({e})") from e
        end = self._size + data.nbytes
        self._entries[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [self._size, end],
        }
        self._size = end

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def close(self) -> None:
        """Write the header, fsync, and give the file its name (then its directory's entry)."""
        file = self._opened()
        header = json.dumps(self._entries, separators=(",", ":")).encode()
        try:
            if 8 + len(header) <= self._room:
                file.seek(0)
                file.write(struct.pack("<Q", self._room - 8))
                file.write(header.ljust(self._room - 8, b" "))
            else:  # more or longer names than room was kept for: the data moves once
                file.close()
                self._file = file = self._moved(header)
            file.flush()
            os.fsync(file.fileno())  # the bytes are on disk before the name points at them
            file.close()
            self._file = None
            self._tmp.replace(self.path)
            self._done = True
            fsync_path(self.path.parent)  # and the rename too
        except OSError as e:
            self.abort()
            raise CheckpointError(f"{self._what}: cannot write {self.path} ({e})") from e

    def _moved(self, header: bytes) -> BinaryIO:
        moved = self._tmp.with_name(self._tmp.name + ".moved")
        header = header.ljust(len(header) + (-len(header) % 8), b" ")
        with open(self._tmp, "rb") as src:
            dst = open(moved, "wb", opener=private_open)  # noqa: SIM115 (the caller closes it)
            try:
                dst.write(struct.pack("<Q", len(header)))
                dst.write(header)
                src.seek(self._room)
                shutil.copyfileobj(src, dst, 16 << 20)
            except OSError:
                dst.close()
                moved.unlink(missing_ok=True)
                raise
        moved.replace(self._tmp)
        return dst

    def abort(self) -> None:
        """Remove the partial file (nothing once closed)."""
        if self._done:
            return
        self._done = True
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        with contextlib.suppress(OSError):
            self._tmp.unlink(missing_ok=True)
            self._tmp.with_name(self._tmp.name + ".moved").unlink(missing_ok=True)


def _load_sync_file_range() -> Callable[[int, int, int], int] | None:
    """Linux's sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE), where libc has it."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError, TypeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return lambda fd, offset, nbytes: int(call(fd, offset, nbytes, 2))


_SYNC_FILE_RANGE = _load_sync_file_range()


def _write_back(file: BinaryIO, offset: int, nbytes: int) -> None:
    """Start writing a tensor's bytes to disk now, without waiting: the disk works while the
    next tensors are copied into the page cache, and the final fsync waits for less (a large
    stage's file is written faster than by one write and one fsync). Large tensors only."""
    if _SYNC_FILE_RANGE is None or nbytes < _WRITE_BACK_BYTES:
        return
    file.flush()
    _SYNC_FILE_RANGE(file.fileno(), offset, nbytes)  # advice: its failure changes nothing


def _check_finite(step: int, stage: int, name: str, tensor: torch.Tensor) -> None:
    if not _finite(tensor):
        raise CheckpointError(
            f"checkpoint of step {step}, stage {stage}: {name} holds NaN or infinite values;"
            f" not written"
        )


def _finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in `tensor`: its smallest and largest values are finite (NaN
    propagates through both), read in one vectorised pass without a mask the size of the
    tensor (5-8x faster than a norm or `isfinite().all()` on a CPU: a checkpoint reads its state
    once more for it)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor.detach())
    return bool(torch.isfinite(low) & torch.isfinite(high))


def seal(root: Path, step: int, stages: int) -> None:
    """Mark step `step`'s checkpoint complete: every stage's file is written."""
    manifest = json.dumps({"step": step, "stages": stages, "data_position": step}).encode()
    _atomic(_dir(root, step) / "manifest.json", lambda f: f.write(manifest), f"seal of step {step}")


def save_file(path: Path, obj: object, what: str) -> None:
    """`torch.save(obj)` to `path` as every checkpoint file is written (fsynced, whole or not at
    all; `CheckpointError` on failure): the scheduler's final model of a job, for one."""
    _atomic(path, lambda f: torch.save(obj, f), what)


def discard(root: Path, step: int) -> None:
    """Remove step `step`'s checkpoint, which could not be completed (never one that is sealed):
    its stage files only take room a later checkpoint needs."""
    directory = _dir(root, step)
    if not (directory / "manifest.json").exists():
        shutil.rmtree(directory, ignore_errors=True)


def prune(root: Path, keep: int) -> list[int]:
    """Delete the sealed checkpoints under `root` but the newest `keep` (at least 1: the newest
    is what a rollback and an export fall back to); returns their steps, oldest first. One not
    sealed (being written) is left alone. The manifest goes first: a directory half deleted is
    never taken for a checkpoint."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the newest sealed checkpoint), got {keep}")
    old = sealed(root)[:-keep]
    for step in old:
        (_dir(root, step) / "manifest.json").unlink(missing_ok=True)
        shutil.rmtree(_dir(root, step), ignore_errors=True)
    return old


def drop_after(root: Path, step: int) -> list[int]:
    """Delete the checkpoints after `step` (they hold a banned peer's work: a rollback to
    `step` retrains those steps without it), by their directories' names: one whose manifest
    cannot be read now would be sealed once it can; returns the steps deleted (one the disk
    keeps is said at ERROR, for its caller never to use). The manifest goes first."""
    dropped = []
    for s in [s for s in named(root) if s > step]:
        try:
            (_dir(root, s) / "manifest.json").unlink(missing_ok=True)
        except OSError as e:  # kept by the disk (read-only, another's): its caller skips it
            log.error(
                "checkpoint %s (a banned peer's work) cannot be deleted: %s", _dir(root, s), e
            )
            continue
        shutil.rmtree(_dir(root, s), ignore_errors=True)
        dropped.append(s)
    return dropped


def sweep(root: Path) -> list[str]:
    """Remove what a write that never ended left under `root` (a job's checkpoint directory,
    read before anything of this process writes there): a step directory never sealed, and the
    temporary files writes rename into place; returns their names. A process killed mid-write
    left them, each up to a model and its optimizer's state, for as long as the job lived."""
    gone = []
    for directory in sorted(root.glob("step-*")):
        if directory.is_dir() and not (directory / "manifest.json").exists():
            shutil.rmtree(directory, ignore_errors=True)
            gone.append(directory.name)
    for tmp in sorted([*root.glob(".*.tmp"), *root.glob("step-*/.*.tmp")]):
        tmp.unlink(missing_ok=True)
        gone.append(str(tmp.relative_to(root)))
    return gone


def sealed(root: Path) -> list[int]:
    """The steps of the complete checkpoints under `root`, oldest first. One whose manifest
    cannot be read (EIO, EACCES: not a torn file, which is never renamed into place) is passed
    over, said at WARNING: a rollback goes further back, and its log says why."""
    steps = []
    for manifest in root.glob("step-*/manifest.json"):
        try:
            steps.append(int(json.loads(manifest.read_text())["step"]))
        except FileNotFoundError:
            continue  # deleted since the glob (pruned)
        except OSError as e:
            log.warning("checkpoint %s cannot be read, passed over: %s", manifest.parent.name, e)
        except (ValueError, KeyError, TypeError):
            continue  # a foreign file is not a checkpoint (a list, a number, a null step)
    return sorted(steps)


def named(root: Path) -> list[int]:
    """The steps of the checkpoints under `root` with a manifest, readable or not, by their
    directories' names (one being written has none yet)."""
    names = [m.parent.name.removeprefix("step-") for m in root.glob("step-*/manifest.json")]
    return sorted(int(n) for n in names if n.isdigit())


def latest(root: Path) -> int | None:
    """The newest complete checkpoint's step, if any."""
    return max(sealed(root), default=None)


def load_stage(root: Path, step: int, stage: int) -> dict[str, torch.Tensor]:
    """Stage `stage`'s state in the checkpoint after `step`: its tensors map the file's pages
    (safetensors' loading maps them; `mmap` does for the older `.pt`), so a reader that sends a
    stage on (a rollback, one stage at a time) holds page cache, not a copy of the stage."""
    path = _dir(root, step) / f"stage-{stage}.safetensors"
    if path.exists():
        return load_file(path)
    # a checkpoint written before the safetensors format
    state: dict[str, torch.Tensor] = torch.load(
        path.with_suffix(".pt"), weights_only=True, mmap=True
    )
    return state


def load_model(root: Path, step: int) -> dict[str, torch.Tensor]:
    """The whole model's parameters from a complete checkpoint (for export)."""
    stages = json.loads((_dir(root, step) / "manifest.json").read_text())["stages"]
    model: dict[str, torch.Tensor] = {}
    for k in range(stages):
        for name, value in load_stage(root, step, k).items():
            if name.startswith("param/"):
                model[name.removeprefix("param/")] = value
    return model
