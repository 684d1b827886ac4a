"""A machine's cache of fetched checkpoints and data files drops the partial fetches nobody went
on with (`swarm.rpc.cache_room`): a fetch a job's end cut short stayed for good (up to a whole
checkpoint, ~14 GB for a 7B model)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from swarm.rpc.cache_room import STALE_S, drop_stale_partials

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
