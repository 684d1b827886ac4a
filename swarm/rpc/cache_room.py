"""A machine's cache of fetched things (starting checkpoints, data files) keeps what is in use
and drops what nobody uses.

Why: a stage server fetches each job's starting checkpoint it lacks into `<cache>/init/<pin>/`
through `<pin>.partial/` (`swarm.rpc.init_fetch`), a trainer each data file into
`<cache>/data/<pin>` (`client.job_data`, through `fetch_file`'s own partial). A volunteer's
machine serves job after job: every checkpoint it ever fetched stayed (~14 GB each for a 7B
model in bf16), and so did a fetch a job's end cut short, until the disk was full.

- **Partial fetches** of other pins that nobody has touched for `STALE_S` and that no fetch holds
  now (its lock, `cache_lock`) go at each use of the cache: a fetch a restart cut short goes on
  within a day; an older one is fetched anew if a job needs it again.
- **Whole items** are marked in use: a process holds a shared lock on the item's use file
  (`<locks>/<kind>-<pin>.use`, `hold`) for as long as it may read the item (a stage server while
  it knows the job: it reads its checkpoint again at each assignment and move; a trainer for its
  run), taken before it looks for the item, so nothing removes it between the look and the read.
  An item nobody holds goes once unused for `ITEM_STALE_S`, and sooner, least recently used
  first, where a fetch needs the room (`drop_unused_items`). The remover holds the use file
  exclusively while it removes the item and unlinks it then; a holder that waited on the old
  file finds it gone and takes the new one (the item is fetched anew).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

from swarm.errors import ConfigError
from swarm.ops.file_locks import taken_now

__all__ = [
    "HEADROOM",
    "ITEM_STALE_S",
    "PARTS",
    "STALE_S",
    "Use",
    "Uses",
    "drop_stale_partials",
    "drop_unused_items",
    "hold",
    "holding",
    "make_room",
    "tidy",
    "use_file",
]

log = logging.getLogger(__name__)

STALE_S = 86400.0  # a partial fetch untouched this long is dropped (s)
REMOVING = "removing"  # the last suffix of an item's name while it is removed (`_removed_item`)
# the last suffix of what a fetch under way, or a removal, writes beside its item
PARTS = ("partial", "manifest", REMOVING)
ITEM_STALE_S = 7 * 86400.0  # a whole item nobody used this long is dropped (s): a week's jobs
HEADROOM = 1 << 30  # bytes a fetch leaves free on the disk, where unused items can make room
HOLD_WAIT_S = 600.0  # how long a hold waits for a removal under way (rmtree of a checkpoint)
_HOLD_POLL_S = 0.05


class Use:
    """A shared hold on one cached item (its use file's lock): no `drop_unused_items` removes
    the item while it is held. Released with `release`, or with the process."""

    def __init__(self, fd: int, what: str) -> None:
        self._fd: int | None = fd
        self.what = what

    def release(self) -> None:
        """Let go, the item's last use now: a checkpoint held through a month's job is a week
        from going when the job ends, not due at once."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.utime(self._fd)
            os.close(self._fd)
            self._fd = None


class Uses:
    """A process's holds on cached items, by holder (a job id): released together when the
    holder no longer reads them (a stage server forgets the job, a trainer's run ends)."""

    def __init__(self) -> None:
        self._held: dict[str, list[Use]] = {}

    def keep(self, holder: str, use: Use) -> None:
        self._held.setdefault(holder, []).append(use)

    def held(self, holder: str) -> list[str]:
        """What `holder` holds, by item."""
        return [use.what for use in self._held.get(holder, [])]

    def release(self, holder: str) -> None:
        for use in self.take_out(holder):
            use.release()

    def take_out(self, holder: str) -> list[Use]:
        """`holder`'s holds, no longer kept here: for the caller to release once nothing of its
        reads the items (a stage server's worker may still be building from one)."""
        return self._held.pop(holder, [])

    def close(self) -> None:
        for holder in list(self._held):
            self.release(holder)


def use_file(locks: Path, kind: str, pin: str) -> Path:
    """Item `pin` of `kind`'s use file: held shared by its users, exclusively by its removal."""
    return locks / f"{kind}-{pin}.use"


async def hold(locks: Path, kind: str, pin: str, wait_s: float = HOLD_WAIT_S) -> Use:
    """A hold on item `pin` of `kind`, taken before the item is looked for, its last use now.
    Polled without blocking (a removal under way holds the file for as long as its rmtree), so
    a cancel ends it at once and leaves nothing held; bounded by `wait_s`."""
    path = use_file(locks, kind, pin)
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            held = _held_shared(fd, path)
        except BaseException:
            os.close(fd)
            raise
        if held:
            return Use(fd, f"{kind}/{pin}")
        os.close(fd)  # being removed, or the file a removal unlinked: the item went with it
        if time.monotonic() > deadline:
            raise ConfigError(
                f"{kind} {pin} of this machine's cache was being removed for over "
                f"{wait_s:.0f} s ({path} held): is another process stuck removing it?"
            )
        await asyncio.sleep(_HOLD_POLL_S)


def _held_shared(fd: int, path: Path) -> bool:
    """`fd` locked shared, and still the file at `path` (a removal unlinks it while it holds
    it exclusively), its time now: the item's last use, which `drop_unused_items` reads."""
    if not taken_now(fd, shared=True) or not _same_file(fd, path):
        return False
    os.utime(fd)
    return True


@contextlib.asynccontextmanager
async def holding(uses: Uses, holder: str, locks: Path, kind: str, pin: str) -> AsyncIterator[None]:
    """Item `pin` held (`hold`) while the body looks for it and fetches it; kept by `holder` in
    `uses` once the body is done, let go if it fails (nothing to read)."""
    use = await hold(locks, kind, pin)
    try:
        yield
    except BaseException:
        use.release()
        raise
    uses.keep(holder, use)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == path.stat().st_ino
    except FileNotFoundError:
        return False


def _free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def tidy(cache: Path, kind: str, using: str) -> None:
    """At a use of item `using` of `kind` in `cache`: the other pins' stale partial fetches go,
    and the items nobody used for `ITEM_STALE_S` (blocking: a caller on a loop runs it on a
    thread)."""
    folder, locks = cache / kind, cache / "locks"
    drop_stale_partials(folder, locks, kind, using)
    drop_unused_items(folder, locks, kind, using)


def drop_unused_items(
    folder: Path,
    locks: Path,
    kind: str,
    using: str,
    need: int = 0,
    stale_s: float = ITEM_STALE_S,
    free: Callable[[Path], int] = _free_bytes,
) -> list[str]:
    """Remove the whole items in `folder` of pins other than `using` that no process holds
    (`hold`): those unused for `stale_s`, and, least recently used first, as many more as it
    takes to leave `need` bytes and `HEADROOM` free on the disk; their names. The use files of
    items no longer here go too (a fetch that failed)."""
    items = []
    for path in folder.iterdir() if folder.is_dir() else ():
        if "." in path.name or path.name == using:
            continue  # a partial fetch (drop_stale_partials), or the item in use now
        with contextlib.suppress(FileNotFoundError):
            items.append((*_last_use(path, use_file(locks, kind, path.name)), path))
    removed: list[str] = []
    now = time.time()
    for used, stamped, path in sorted(items):
        short = need > 0 and free(folder) < need + HEADROOM
        if now - used < stale_s and not short:
            break  # the rest were used later still
        # for its age alone: not if it was held since it was listed (its file stamped later)
        since = used if stamped and not short else None
        if _removed_item(path, use_file(locks, kind, path.name), since):
            removed.append(path.name)
    if removed:
        log.info(
            "removed cached %s nobody uses (unused for %.0f s, or room for %d bytes) from %s: %s",
            kind,
            stale_s,
            need,
            folder,
            removed,
        )
    _drop_orphan_uses(folder, locks, kind)
    return removed


def make_room(
    folder: Path,
    locks: Path,
    kind: str,
    using: str,
    need: int,
    free: Callable[[Path], int] = _free_bytes,
) -> None:
    """Room in `folder` for `need` more bytes of item `using`: `drop_unused_items`, then, where
    the disk still has less than `need` free (what is left is held, or could not be removed:
    each said), a `ConfigError` that says so before a fetch fills the disk and dies of it."""
    drop_unused_items(folder, locks, kind, using, need, free=free)
    left = free(folder)
    if left < need:
        raise ConfigError(
            f"no room under {folder} for {kind} {using[:16]}: {need / 1e9:.3g} GB more needed, "
            f"{left / 1e9:.3g} GB free; the cached items left there are in use or could not be "
            "removed (the warnings say which)"
        )


def _last_use(item: Path, use: Path) -> tuple[float, bool]:
    """When `item` was last held (its use file's time), or fetched (one from before holds);
    and whether that is its use file's."""
    try:
        return use.stat().st_mtime, True
    except FileNotFoundError:
        return item.lstat().st_mtime, False


def _removed_item(item: Path, use: Path, unused_since: float | None) -> bool:
    """Remove `item` unless it is held (`use` cannot be taken exclusively at once), or was used
    after `unused_since`; whether it went. It is renamed out of its name first (no half-removed
    item is ever taken for a whole one), and its use file unlinked before it is let go (a
    holder that waited on it takes the new one; the item is fetched anew)."""
    with _exclusively(use) as fd:
        if fd is None:
            return False  # held (or another removal's): it stays
        if unused_since is not None and os.fstat(fd).st_mtime > unused_since:
            return False  # held and let go since it was listed: used, not stale
        going = item.with_name(f"{item.name}.{REMOVING}")
        if not _remove(going):  # a removal cut short (a crash) or stuck, of an item fetched again
            # since: what is stuck keeps its name, and this one takes another (a rename onto a
            # directory not empty failed, and with it every later use of the pin)
            going = item.with_name(f"{item.name}.{secrets.token_hex(4)}.{REMOVING}")
        try:
            item.rename(going)
        except FileNotFoundError:
            return False  # gone already
        removed = _remove(going)
        with contextlib.suppress(FileNotFoundError):
            use.unlink()  # out of its name: a holder fetches it anew, whether or not it went
        return removed


def _drop_orphan_uses(folder: Path, locks: Path, kind: str) -> None:
    """Unlink the use files nobody holds whose item is not here (one removed by hand, or whose
    fetch failed): one file per item would stay for good."""
    for use in locks.glob(f"{kind}-*.use") if locks.is_dir() else ():
        with _exclusively(use) as fd:
            if fd is not None and not (folder / use.name[len(kind) + 1 : -len(".use")]).exists():
                with contextlib.suppress(FileNotFoundError):
                    use.unlink()


@contextlib.contextmanager
def _exclusively(use: Path) -> Iterator[int | None]:
    """`use` held exclusively, its descriptor; None where a holder has it, or where it is a file
    another removal unlinked (the file at its name now may be a holder's)."""
    with _at_once(use) as fd:
        yield fd if fd is not None and _same_file(fd, use) else None


@contextlib.contextmanager
def _at_once(lock: Path) -> Iterator[int | None]:
    """`lock` held exclusively where nobody holds it now: its descriptor; else None."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        yield fd if taken_now(fd) else None
    finally:
        os.close(fd)


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
    with _at_once(lock) as fd:
        if fd is None:
            return False  # being fetched: it stays
        return _remove(path)


def _remove(path: Path) -> bool:
    """Remove `path` (a tree, or a file); whether it went. What stops it is said: its room is
    not made, and a caller short of room must not count it."""
    failed: list[str] = []

    def note(_: object, at: str, error: tuple[type[BaseException], BaseException, object]) -> None:
        if not isinstance(error[1], FileNotFoundError):
            failed.append(f"{at}: {error[1]}")

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, onerror=note)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            failed.append(f"{path}: {e}")
    if failed:
        log.warning(
            "cannot remove %s from the cache (%s%s): its room is not freed",
            path,
            failed[0],
            f"; {len(failed) - 1} more" if len(failed) > 1 else "",
        )
    return not failed
