"""A machine's cache of fetched things (starting checkpoints, data files) drops the partial
fetches nobody went on with.

Why: a stage server fetches each job's starting checkpoint it lacks into `<cache>/init/<pin>/`
through `<pin>.partial/` (`swarm.rpc.init_fetch`), a trainer each data file into
`<cache>/data/<pin>` (`client.job_data`, through `fetch_file`'s own partial). A fetch a job's end
cut short left its partial for good (up to a whole checkpoint, ~14 GB for a 7B model in bf16),
where only a fetch of the same pin would go on with it. So each use of the cache removes the
other pins' partial fetches that nobody has touched for `STALE_S` and that no fetch holds now
(its lock, `cache_lock`): a fetch a restart cut short goes on within a day; an older one is
fetched anew if a job needs it again. Whole items are kept: a process may read one long after
its fetch (a stage server reads its checkpoint again at each assignment), and nothing marks an
item in use yet (left: docs/decisions.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
from pathlib import Path

__all__ = ["PARTS", "STALE_S", "drop_stale_partials"]

log = logging.getLogger(__name__)

STALE_S = 86400.0  # a partial fetch untouched this long is dropped (s)
# the last suffix of what a fetch under way writes beside its item
PARTS = ("partial", "manifest")


def drop_stale_partials(
    folder: Path, locks: Path, kind: str, using: str, stale_s: float = STALE_S
) -> list[str]:
    """Remove the partial fetches in `folder` of pins other than `using` untouched for
    `stale_s`, but for one whose lock (`locks / f"{kind}-{pin}"`) is held; their names."""
    removed = []
    now = time.time()
    for path in sorted(folder.iterdir()) if folder.is_dir() else ():
        pin, _, rest = path.name.partition(".")
        if pin == using or rest.rsplit(".", 1)[-1] not in PARTS:
            continue
        with contextlib.suppress(FileNotFoundError):
            if now - path.lstat().st_mtime < stale_s:
                continue
            if _removed(path, locks / f"{kind}-{pin}"):
                removed.append(path.name)
    if removed:
        log.info(
            "removed partial fetches untouched for %.0f s from %s: %s", stale_s, folder, removed
        )
    return removed


def _removed(path: Path, lock: Path) -> bool:
    """Remove `path` unless `lock` is held (its fetch under way); whether it went."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # being fetched: it stays
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return True
    finally:
        os.close(fd)
