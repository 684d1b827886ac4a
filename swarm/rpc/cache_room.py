"""A machine's cache of fetched things (starting checkpoints, data files) keeps the few used last.

Why: a stage server fetches each job's starting checkpoint it lacks into `<cache>/init/<pin>/`
(`swarm.rpc.init_fetch`), a trainer each data file into `<cache>/data/<pin>`
(`client.job_data`), and nothing took them away: one whole checkpoint (~14 GB for a 7B model in
bf16) per base model a volunteer's machine ever fine-tuned, and the partial fetch a job's end
cut short, for good, until a full disk failed every later fetch. Now each use keeps the
`KEPT` items of its kind used last (the one in use counts as just used) and removes the others,
their partial fetches too. An item being fetched now (its lock held, `cache_lock`) stays. One
removed while a process still reads it is gone only from the folder: what is open stays
readable; a later need fetches it again.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from pathlib import Path

__all__ = ["KEPT", "make_room"]

log = logging.getLogger(__name__)

KEPT = 3  # items of a kind (checkpoints, data files) a machine's cache keeps, the used last


def make_room(folder: Path, locks: Path, kind: str, using: str, kept: int = KEPT) -> list[str]:
    """Keep the `kept` items of `folder` used last, `using` (a pin) first: its paths are
    touched as used now; the others' (a pin's item, its `.partial`, its `.manifest`) removed,
    but for an item whose lock (`locks / f"{kind}-{pin}"`) is held. The pins removed."""
    items: dict[str, list[Path]] = {}
    for path in folder.iterdir() if folder.is_dir() else ():
        items.setdefault(path.name.split(".", 1)[0], []).append(path)
    for path in items.get(using, ()):
        with contextlib.suppress(OSError):
            os.utime(path)
    newest = sorted(items, key=lambda pin: (pin == using, _used(items[pin])), reverse=True)
    removed = []
    for pin in newest[kept:]:
        if _removed(items[pin], locks / f"{kind}-{pin}"):
            removed.append(pin)
    if removed:
        log.info("the cache of %s keeps the %d used last: removed %s", folder, kept, removed)
    return removed


def _used(paths: list[Path]) -> float:
    """When an item was last used (or written): its paths' newest modification time."""
    times = []
    for path in paths:
        with contextlib.suppress(OSError):
            times.append(path.lstat().st_mtime)
    return max(times, default=0.0)


def _removed(paths: list[Path], lock: Path) -> bool:
    """Remove `paths` unless `lock` is held (a fetch of them under way); whether they went."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # being fetched: it stays
        for path in paths:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        return True
    finally:
        os.close(fd)
