"""A remote trainer's data (client.job_data): the file at the submitted path when it is there,
else fetched once into the cache by its pinned sha256, never used when it does not match."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from client.job_data import local_data
from swarm.errors import ConfigError
from swarm.job.config import JobConfig
from swarm.rpc.cache_room import ITEM_STALE_S, Uses, drop_unused_items
from tests.support.jobs import make_job

TEXT = b"the quick brown fox jumps over the lazy dog\n" * 200


def _job(tmp_path: Path, text: bytes = TEXT) -> JobConfig:
    """A text job whose data.path names a file that is not on this machine, pinned to `text`."""
    job = make_job(tmp_path, model={"vocab_size": 256}, data={"kind": "text", "path": "x.txt"})
    digest = hashlib.sha256(text).hexdigest()
    return replace(job, data=replace(job.data, path=tmp_path / "gone" / "x.txt", sha256=digest))


class _Scheduler:
    """The scheduler's FetchData, as the trainer sees it: the bytes it serves, and the asks."""

    def __init__(self, served: bytes) -> None:
        self.served, self.asked = served, 0

    async def fetch(self, validation: bool, offset: int) -> AsyncIterator[bytes]:
        assert not validation
        self.asked += 1
        for at in range(offset, len(self.served), 1000):
            yield self.served[at : at + 1000]


async def test_a_missing_file_is_fetched_once_and_kept_by_its_hash(tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_bytes(TEXT)  # make_job reads it; the job then names another path
    job, scheduler = _job(tmp_path), _Scheduler(TEXT)
    got = await local_data(job, scheduler.fetch, tmp_path / "cache", Uses(), "j")
    assert got.data.path == tmp_path / "cache" / "data" / job.data.sha256
    assert got.data.path.read_bytes() == TEXT and scheduler.asked == 1
    again = await local_data(job, scheduler.fetch, tmp_path / "cache", Uses(), "j")
    assert again.data.path == got.data.path and scheduler.asked == 1  # kept: not fetched again


async def test_a_file_at_its_path_is_used_and_nothing_fetched(tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_bytes(TEXT)
    job, scheduler = _job(tmp_path), _Scheduler(TEXT)
    job = replace(job, data=replace(job.data, path=tmp_path / "x.txt"))
    got = await local_data(job, scheduler.fetch, tmp_path / "cache", Uses(), "j")
    assert got.data.path == tmp_path / "x.txt" and scheduler.asked == 0


async def test_fetched_bytes_that_do_not_match_the_pin_are_refused_and_not_kept(
    tmp_path: Path,
) -> None:
    (tmp_path / "x.txt").write_bytes(TEXT)
    job, scheduler = _job(tmp_path), _Scheduler(TEXT + b"changed since")
    with pytest.raises(ConfigError, match=r"not the .* pinned at submit"):
        await local_data(job, scheduler.fetch, tmp_path / "cache", Uses(), "j")
    assert not any((tmp_path / "cache" / "data").iterdir())  # no partial file left either


async def test_a_fetched_file_is_held_for_the_run_and_unused_ones_go(tmp_path: Path) -> None:
    """A trainer's machine kept every data file it ever fetched; one nobody used for a week goes
    at the next fetch, and the one fetched now is held until the trainer's run lets it go."""
    (tmp_path / "x.txt").write_bytes(TEXT)
    job, scheduler, cache = _job(tmp_path), _Scheduler(TEXT), tmp_path / "cache"
    last_month = cache / "data" / ("9" * 64)
    last_month.parent.mkdir(parents=True)
    last_month.write_bytes(b"an old job's tokens")
    then = time.time() - ITEM_STALE_S - 3600
    os.utime(last_month, (then, then))
    uses = Uses()
    got = await local_data(job, scheduler.fetch, cache, uses, "j")
    assert not last_month.exists() and uses.held("j") == [f"data/{job.data.sha256}"]
    locks = cache / "locks"
    assert drop_unused_items(cache / "data", locks, "data", "other", stale_s=0.0) == []
    uses.close()  # the run ended
    assert drop_unused_items(cache / "data", locks, "data", "other", stale_s=0.0) == [
        job.data.sha256
    ]
    assert not got.data.path.exists()  # type: ignore[union-attr]
