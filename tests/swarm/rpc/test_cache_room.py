"""A machine's cache of fetched checkpoints and data files drops the partial fetches nobody went
on with, and the whole items nobody uses (`swarm.rpc.cache_room`): a fetch a job's end cut short
stayed for good (up to a whole checkpoint, ~14 GB for a 7B model), and so did every checkpoint a
volunteer's machine ever fetched."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time
from pathlib import Path

import pytest

from swarm.errors import ConfigError
from swarm.rpc import cache_room
from swarm.rpc.cache_room import (
    HEADROOM,
    ITEM_STALE_S,
    STALE_S,
    Uses,
    drop_stale_partials,
    drop_unused_items,
    hold,
    make_room,
    use_file,
)
from tests.support.disks import tiny_disk

OLD = STALE_S + 60.0


def _item(folder: Path, name: str, age_s: float, directory: bool = False) -> Path:
    path = folder / name
    if directory:
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"x")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    then = path.stat().st_mtime - age_s
    os.utime(path, (then, then))
    return path


def test_stale_partial_fetches_of_other_pins_go_and_everything_else_stays(tmp_path: Path) -> None:
    cache, locks = tmp_path / "init", tmp_path / "locks"
    _item(cache, "whole", OLD, directory=True)  # a fetched checkpoint, however old: kept
    _item(cache, "cut.partial", OLD, directory=True)  # a fetch a job's end cut short
    _item(cache, "cut.manifest", OLD)
    _item(cache, "cut.manifest.partial", OLD)
    _item(cache, "fresh.partial", 60.0, directory=True)  # a restart's, to go on with soon
    _item(cache, "mine.partial", OLD, directory=True)  # the pin in use now
    removed = drop_stale_partials(cache, locks, "init", using="mine")
    assert removed == ["cut.manifest", "cut.manifest.partial", "cut.partial"]
    assert sorted(p.name for p in cache.iterdir()) == ["fresh.partial", "mine.partial", "whole"]


def test_a_partial_being_fetched_stays(tmp_path: Path) -> None:
    cache, locks = tmp_path / "data", tmp_path / "locks"
    _item(cache, "old.partial", OLD)
    locks.mkdir()
    fd = os.open(locks / "data-old", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process fetching it, slowly
        assert drop_stale_partials(cache, locks, "data", using="new") == []
        assert (cache / "old.partial").exists()
    finally:
        os.close(fd)
    assert drop_stale_partials(cache, locks, "data", using="new") == ["old.partial"]


# -- whole items: held while in use, dropped once nobody used them for a week or a fetch needs
# the room (a volunteer's machine kept every checkpoint it ever fetched, ~14 GB each) ----------
OLD_ITEM = ITEM_STALE_S + 3600.0


def _aged(path: Path, age_s: float) -> None:
    then = time.time() - age_s
    os.utime(path, (then, then))


async def test_whole_items_nobody_used_for_a_week_go_and_held_or_recent_ones_stay(
    tmp_path: Path,
) -> None:
    cache, locks = tmp_path / "init", tmp_path / "locks"
    _item(cache, "old", OLD_ITEM, directory=True)  # fetched for a job long over
    _item(cache, "recent", 86400.0, directory=True)  # yesterday's
    _item(cache, "mine", OLD_ITEM, directory=True)  # the pin being used now
    _item(cache, "held", OLD_ITEM, directory=True)
    _item(cache, "cut.partial", 60.0, directory=True)  # a fetch under way: not an item
    use = await hold(locks, "init", "held")  # a stage server serving its job for weeks
    _aged(use_file(locks, "init", "held"), OLD_ITEM)
    try:
        assert drop_unused_items(cache, locks, "init", using="mine") == ["old"]
        assert sorted(p.name for p in cache.iterdir()) == ["cut.partial", "held", "mine", "recent"]
    finally:
        use.release()
    # let go: used until now, so a week from going (held through a month's job, it was due
    # at once); then it goes, and its use file with it
    assert drop_unused_items(cache, locks, "init", using="mine") == []
    assert drop_unused_items(cache, locks, "init", "mine", stale_s=0.0) == ["recent", "held"]
    assert not use_file(locks, "init", "held").exists()
    assert sorted(p.name for p in cache.iterdir()) == ["cut.partial", "mine"]


async def test_a_fetch_short_of_room_removes_unused_items_least_recently_used_first(
    tmp_path: Path,
) -> None:
    cache, locks = tmp_path / "data", tmp_path / "locks"
    for name, age_days in (("held", 6), ("a", 5), ("b", 4), ("c", 3)):
        _item(cache, name, age_days * 86400.0)
    use = await hold(locks, "data", "held")
    _aged(use_file(locks, "data", "held"), 6 * 86400.0)  # the least recently used: but held

    def free(folder: Path) -> int:  # 60 bytes more for each of a, b, c removed
        return HEADROOM + 50 + 60 * sum(not (cache / n).exists() for n in "abc")

    try:
        # 100 bytes to fetch: a's room is enough; b and c (used later) stay
        assert drop_unused_items(cache, locks, "data", "new", need=100, free=free) == ["a"]
        assert drop_unused_items(cache, locks, "data", "new", need=200, free=free) == ["b", "c"]
        # short still: nothing held goes
        assert drop_unused_items(cache, locks, "data", "new", need=10**9, free=free) == []
        assert (cache / "held").exists()
    finally:
        use.release()


async def test_a_hold_waits_out_a_removal_and_then_holds_what_is_at_the_name(
    tmp_path: Path,
) -> None:
    """A holder that opened the use file a removal then unlinked would hold nothing: it takes
    the new file, so a later removal finds the item held."""
    cache, locks = tmp_path / "init", tmp_path / "locks"
    _item(cache, "p", OLD_ITEM, directory=True)
    locks.mkdir()
    path = use_file(locks, "init", "p")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a removal under way
    holding = asyncio.create_task(hold(locks, "init", "p"))
    await asyncio.sleep(0.2)
    assert not holding.done()  # waits for the removal
    path.unlink()
    os.close(fd)
    use = await asyncio.wait_for(holding, 5)
    try:
        assert drop_unused_items(cache, locks, "init", "other", stale_s=0.0) == []
    finally:
        use.release()
    assert drop_unused_items(cache, locks, "init", "other", stale_s=0.0) == ["p"]


async def test_a_hold_a_removal_never_lets_go_says_so_within_its_bound(tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    locks.mkdir()
    fd = os.open(use_file(locks, "init", "p"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(ConfigError, match="being removed for over 0 s"):
            await hold(locks, "init", "p", wait_s=0.2)
    finally:
        os.close(fd)


def test_uses_are_let_go_by_holder(tmp_path: Path) -> None:
    async def take() -> Uses:
        uses = Uses()
        uses.keep("j", await hold(tmp_path, "init", "a"))
        uses.keep("k", await hold(tmp_path, "init", "b"))
        return uses

    uses = asyncio.run(take())
    assert uses.held("j") == ["init/a"]
    uses.release("j")
    assert uses.held("j") == [] and uses.held("k") == ["init/b"]
    cache = tmp_path / "init"
    _item(cache, "a", OLD_ITEM, directory=True)
    _item(cache, "b", OLD_ITEM, directory=True)
    # both used just now: only a removal that takes any unused item can tell held from not
    assert drop_unused_items(cache, tmp_path, "init", "", stale_s=0.0) == ["a"]
    uses.close()
    assert drop_unused_items(cache, tmp_path, "init", "", stale_s=0.0) == ["b"]


def _swapped_at_first_open(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """`path` replaced by a new file right after cache_room's first open of it: a removal that
    unlinked it between a holder's open and its lock (or a second removal's)."""
    real, calls = os.open, []

    def opened(name: str | os.PathLike[str], flags: int, mode: int = 0o777) -> int:
        fd = real(name, flags, mode)
        if Path(name) == path and not calls:
            calls.append(fd)
            path.unlink()
            path.touch()
        return fd

    monkeypatch.setattr(cache_room.os, "open", opened)


async def test_a_holder_whose_use_file_was_unlinked_under_it_takes_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, locks = tmp_path / "init", tmp_path / "locks"
    _item(cache, "p", OLD_ITEM, directory=True)
    locks.mkdir()
    use_file(locks, "init", "p").touch()
    _swapped_at_first_open(monkeypatch, use_file(locks, "init", "p"))
    use = await hold(locks, "init", "p")
    monkeypatch.undo()
    try:  # held on the file at the name: a removal finds it held
        assert drop_unused_items(cache, locks, "init", "other", stale_s=0.0) == []
    finally:
        use.release()


def test_a_removal_whose_use_file_was_unlinked_under_it_removes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another removal unlinked the file this one opened: the file at the name now may be a
    holder's, so this one skips the item."""
    cache, locks = tmp_path / "init", tmp_path / "locks"
    _item(cache, "p", OLD_ITEM, directory=True)
    locks.mkdir()
    use_file(locks, "init", "p").touch()
    _swapped_at_first_open(monkeypatch, use_file(locks, "init", "p"))
    assert drop_unused_items(cache, locks, "init", "other", stale_s=0.0) == []
    assert (cache / "p").is_dir()


def test_a_removal_cut_short_leaves_nothing_under_the_items_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A removal killed mid-rmtree left a part of the checkpoint under its name, which a fetch
    takes for whole: it is renamed first, and the leftover goes with the stale partials."""
    cache, locks = tmp_path / "init", tmp_path / "locks"
    _item(cache, "p", OLD_ITEM, directory=True)
    real, calls = cache_room._remove, []

    def killed(path: Path) -> bool:
        calls.append(path.name)
        if len(calls) == 2:  # the item's own rmtree (the first clears an old leftover)
            raise KeyboardInterrupt("killed mid-removal")
        return real(path)

    monkeypatch.setattr(cache_room, "_remove", killed)
    with pytest.raises(KeyboardInterrupt):
        drop_unused_items(cache, locks, "init", "other", stale_s=0.0)
    monkeypatch.undo()
    assert sorted(p.name for p in cache.iterdir()) == ["p.removing"]  # never "p"
    assert drop_stale_partials(cache, locks, "init", "other", stale_s=0.0) == ["p.removing"]


def test_an_item_held_and_let_go_after_it_was_listed_is_not_removed_as_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, locks = tmp_path / "init", tmp_path / "locks"
    _item(cache, "p", OLD_ITEM, directory=True)
    locks.mkdir()
    use = use_file(locks, "init", "p")
    use.touch()  # used just now, after the listing read a month-old time
    listed = time.time() - OLD_ITEM
    monkeypatch.setattr(cache_room, "_last_use", lambda item, use: (listed, True))
    assert drop_unused_items(cache, locks, "init", "other") == []
    assert (cache / "p").is_dir()


async def test_use_files_of_items_not_here_go_unless_held(tmp_path: Path) -> None:
    cache, locks = tmp_path / "data", tmp_path / "locks"
    cache.mkdir()
    held = await hold(locks, "data", "fetching")  # a fetch under way: no item yet
    (await hold(locks, "data", "failed")).release()  # a fetch that failed
    (await hold(locks, "init", "other-kind")).release()
    try:
        drop_unused_items(cache, locks, "data", "")
        assert sorted(p.name for p in locks.iterdir()) == [
            "data-fetching.use",
            "init-other-kind.use",
        ]
    finally:
        held.release()


def test_an_item_that_cannot_be_removed_is_said_and_not_counted_as_room(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its removal was `rmtree(ignore_errors=True)`: an item it could not remove was named as
    removed, its room as made, and the fetch that needed the room started anyway, to die of a
    full disk (a review found it). A mount inside the item keeps it here (root can remove any
    file, not a mount point)."""
    cache, locks = tmp_path / "init", tmp_path / "locks"
    stuck = _item(cache, "stuck", OLD_ITEM, directory=True)
    _item(cache, "old", OLD_ITEM + 60, directory=True)  # used before: tried first
    mounts = (stuck / "mounted", cache / "stuck.removing" / "mounted")  # before, after the rename
    with tiny_disk(mounts[0], unmount=mounts):
        (stuck / "mounted" / "shard").write_bytes(b"x")
        _aged(stuck, OLD_ITEM)  # the mount made it new
        with caplog.at_level(logging.WARNING, logger="swarm.rpc.cache_room"):
            assert drop_unused_items(cache, locks, "init", using="mine") == ["old"]
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(said) == 1 and "stuck" in said[0] and "busy" in said[0], said
        assert "removed" not in " ".join(said)
    assert not (cache / "stuck").exists()  # out of its name all the same: never taken as whole


def test_an_item_fetched_again_beside_its_stuck_removal_is_removed_all_the_same(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An item whose removal is stuck (`stuck.removing`, a mount inside it) and that was fetched
    again: its next removal renamed it onto the stuck one, which failed (`ENOTEMPTY`) out of
    `drop_unused_items`, so every later use of the pin did too (a review found it). Now it
    goes under a name of its own."""
    cache, locks = tmp_path / "init", tmp_path / "locks"
    stuck = _item(cache, "stuck", OLD_ITEM, directory=True)
    mounts = (stuck / "mounted", cache / "stuck.removing" / "mounted")
    with tiny_disk(mounts[0], unmount=mounts):
        (stuck / "mounted" / "shard").write_bytes(b"x")
        _aged(stuck, OLD_ITEM)
        with caplog.at_level(logging.WARNING, logger="swarm.rpc.cache_room"):
            assert drop_unused_items(cache, locks, "init", using="mine") == []
            _item(cache, "stuck", OLD_ITEM, directory=True)  # fetched again, unused since
            assert drop_unused_items(cache, locks, "init", using="mine") == ["stuck"]
        assert not (cache / "stuck").exists()
        left = sorted(p.name for p in cache.iterdir())
        assert left == ["stuck.removing"], left  # the stuck one alone, still said
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(said) == 2 and all("stuck.removing" in s for s in said), said


def test_no_room_left_after_the_unused_items_went_is_said_before_a_fetch(
    tmp_path: Path,
) -> None:
    cache, locks = tmp_path / "init", tmp_path / "locks"
    _item(cache, "old", 60.0, directory=True)  # used a minute ago: stays unless room is short

    def free(_: Path) -> int:
        return HEADROOM + 100  # what no removal here changes (nothing held but the item)

    make_room(cache, locks, "init", "mine", 50, free=free)  # room enough: nothing removed
    assert (cache / "old").is_dir()
    with pytest.raises(ConfigError, match=r"no room under .* for init mine: .* GB more needed"):
        make_room(cache, locks, "init", "mine", HEADROOM + 200, free=free)
    assert not (cache / "old").exists()  # tried first: gone, and still not room enough
