"""A machine's cache of fetched checkpoints and data files keeps the few used last
(`swarm.rpc.cache_room`): every one ever fetched stayed, and the partial fetch a job's end cut
short, for good (a 7B checkpoint is ~14 GB)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from swarm.rpc.cache_room import make_room


def _item(folder: Path, name: str, age_s: float, directory: bool = True) -> Path:
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


def test_the_items_used_last_stay_and_the_others_go_their_partials_too(tmp_path: Path) -> None:
    cache, locks = tmp_path / "init", tmp_path / "locks"
    for age, pin in enumerate(("b", "c", "d", "e")):  # b used last, e first
        _item(cache, pin, age * 100.0)
    _item(cache, "f.partial", 500.0)  # a fetch a job's end cut short
    _item(cache, "f.manifest", 500.0, directory=False)
    _item(cache, "a", 1000.0)  # the oldest, and the one in use now
    removed = make_room(cache, locks, "init", using="a", kept=3)
    assert sorted(p.name for p in cache.iterdir()) == ["a", "b", "c"]
    assert sorted(removed) == ["d", "e", "f"]
    # used now: the newest, however old it was
    assert sorted(make_room(cache, locks, "init", using="c", kept=1)) == ["a", "b"]
    assert [p.name for p in cache.iterdir()] == ["c"]


def test_an_item_being_fetched_stays(tmp_path: Path) -> None:
    cache, locks = tmp_path / "data", tmp_path / "locks"
    _item(cache, "old", 1000.0, directory=False)
    _item(cache, "new", 0.0, directory=False)
    locks.mkdir()
    fd = os.open(locks / "data-old", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process fetching it
        assert make_room(cache, locks, "data", using="new", kept=1) == []
        assert (cache / "old").exists()
    finally:
        os.close(fd)
    assert make_room(cache, locks, "data", using="new", kept=1) == ["old"]
