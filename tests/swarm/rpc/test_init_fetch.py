"""A starting checkpoint not on this machine (`swarm.rpc.init_fetch.local_init`): fetched file by
file into `<cache>/init/<pin>/`, once; the manifest first, checked against the pin; a broken
stream resumed; a manifest naming a path outside the directory, or a file that is not its
manifest's, refused with nothing left under the final name."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from swarm.errors import ConfigError, PeerUnavailable
from swarm.job.config import JobConfig
from swarm.job.manifest import digest, encode, manifest_of
from swarm.rpc.cache_room import ITEM_STALE_S, Uses, drop_unused_items, use_file
from swarm.rpc.init_fetch import local_init
from tests.support.disks import tiny_disk
from tests.support.jobs import make_job


def _checkpoint(directory: Path) -> Path:
    (directory / "sub").mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(bytes(range(256)) * 50)
    (directory / "config.json").write_text('{"num_hidden_layers": 2}')
    (directory / "sub" / "extra.txt").write_text("a file in a folder")
    return directory


class _Scheduler:
    """FetchInit as a fetcher sees it, over the directory `served`: "" is its manifest (or
    `manifest`, as given), else one of its files, in 1000-byte chunks; what was asked is kept,
    and the first stream of `breaks` breaks after 1000 bytes."""

    def __init__(self, served: Path, manifest: bytes | None = None, breaks: str = "") -> None:
        self.served, self.breaks = served, breaks
        self.manifest = manifest if manifest is not None else encode(manifest_of(served))
        self.asked: list[tuple[str, int]] = []

    async def fetch(self, path: str, offset: int) -> AsyncIterator[bytes]:
        self.asked.append((path, offset))
        data = (self.served / path).read_bytes() if path else self.manifest
        broken = path == self.breaks and offset == 0
        for at in range(offset, len(data), 1000):
            if broken and at >= 1000:
                raise PeerUnavailable("UNAVAILABLE: the link dropped")
            yield data[at : at + 1000]


def _job(tmp_path: Path, pin: str) -> JobConfig:
    """A job starting from a checkpoint at a path this machine lacks, pinned to `pin`."""
    job = make_job(tmp_path)
    return replace(job, model=replace(job.model, init_from=tmp_path / "gone", init_sha256=pin))


async def test_a_missing_checkpoint_is_fetched_once_into_the_cache_by_its_pin(
    tmp_path: Path,
) -> None:
    served = _checkpoint(tmp_path / "served")
    pin = digest(manifest_of(served))
    scheduler, cache = _Scheduler(served, breaks="model.safetensors"), tmp_path / "cache"
    got = await local_init(_job(tmp_path, pin), scheduler.fetch, cache, Uses(), "j")
    kept = cache / "init" / pin
    assert got.model.init_from == kept and digest(manifest_of(kept)) == pin  # every file, whole
    assert ("model.safetensors", 1000) in scheduler.asked  # the broken stream went on
    assert sorted(p.name for p in (cache / "init").iterdir()) == [pin]  # no partial, no manifest
    asked = len(scheduler.asked)
    again = await local_init(_job(tmp_path, pin), scheduler.fetch, cache, Uses(), "j")
    assert again.model.init_from == kept and len(scheduler.asked) == asked  # kept: none asked


async def test_a_checkpoint_on_this_machine_is_read_there(tmp_path: Path) -> None:
    served = _checkpoint(tmp_path / "served")
    job = _job(tmp_path, digest(manifest_of(served)))
    job = replace(job, model=replace(job.model, init_from=served))
    scheduler = _Scheduler(served)
    assert (await local_init(job, scheduler.fetch, tmp_path / "cache", Uses(), "j")) == job
    assert scheduler.asked == []


async def test_a_manifest_naming_a_path_outside_the_directory_is_refused(tmp_path: Path) -> None:
    served = _checkpoint(tmp_path / "served")
    evil = json.dumps({"files": [["../../escape", 5, "0" * 64]]}, separators=(",", ":")).encode()
    pin = hashlib.sha256(evil).hexdigest()  # a scheduler that pinned it too
    scheduler = _Scheduler(served, manifest=evil)
    with pytest.raises(ConfigError, match=r"'\.\./\.\./escape': refused"):
        await local_init(_job(tmp_path, pin), scheduler.fetch, tmp_path / "cache", Uses(), "j")
    assert scheduler.asked == [("", 0)]  # no file asked for
    assert not (tmp_path / "escape").exists() and not (tmp_path / "cache" / "init" / pin).exists()


async def test_a_file_that_is_not_its_manifests_is_refused_and_removed(tmp_path: Path) -> None:
    served = _checkpoint(tmp_path / "served")
    pin = digest(manifest_of(served))
    scheduler = _Scheduler(served)
    (served / "config.json").write_text('{"num_hidden_layers": 4}')  # changed after the pin
    with pytest.raises(ConfigError, match=r"config\.json fetched from the scheduler has sha256"):
        await local_init(_job(tmp_path, pin), scheduler.fetch, tmp_path / "cache", Uses(), "j")
    kept = tmp_path / "cache" / "init" / pin
    assert not kept.exists()  # never whole under its name
    staging = kept.parent / f"{pin}.partial"
    assert not (staging / "config.json").exists() and not (staging / "config.json.partial").exists()


async def test_a_manifest_that_is_not_the_pinned_one_is_refused(tmp_path: Path) -> None:
    served = _checkpoint(tmp_path / "served")
    scheduler = _Scheduler(served)
    with pytest.raises(ConfigError, match=r"not the .* pinned at submit"):
        await local_init(_job(tmp_path, "2" * 64), scheduler.fetch, tmp_path / "cache", Uses(), "j")
    assert scheduler.asked == [("", 0)]


async def test_two_fetchers_of_one_machine_fetch_it_once(tmp_path: Path) -> None:
    served = _checkpoint(tmp_path / "served")
    job, scheduler = _job(tmp_path, digest(manifest_of(served))), _Scheduler(served)
    cache = tmp_path / "cache"
    first, second = await asyncio.gather(
        local_init(job, scheduler.fetch, cache, Uses(), "j"),
        local_init(job, scheduler.fetch, cache, Uses(), "j"),
    )
    assert first == second and scheduler.asked.count(("", 0)) == 1  # the second waited


async def test_a_fetched_checkpoint_is_held_until_let_go_and_unused_ones_go(
    tmp_path: Path,
) -> None:
    """A volunteer's machine kept every checkpoint it ever fetched (~14 GB each for a 7B model).
    One nobody used for a week goes at the next fetch; the one fetched now is held by its job
    (`uses`) for as long as the stage server knows the job, and only then can go."""
    served = _checkpoint(tmp_path / "served")
    pin, cache = digest(manifest_of(served)), tmp_path / "cache"
    last_month = _checkpoint(cache / "init" / ("9" * 64))  # a job's, long over
    then = time.time() - ITEM_STALE_S - 3600
    os.utime(last_month, (then, then))
    uses = Uses()
    got = await local_init(_job(tmp_path, pin), _Scheduler(served).fetch, cache, uses, "j")
    assert not last_month.exists()
    assert uses.held("j") == [f"init/{pin}"]
    locks = cache / "locks"
    # another process making room for anything: the held checkpoint stays
    assert drop_unused_items(cache / "init", locks, "init", "other", stale_s=0.0) == []
    uses.release("j")  # the job forgotten
    assert drop_unused_items(cache / "init", locks, "init", "other", stale_s=0.0) == [pin]
    assert not got.model.init_from.exists()  # type: ignore[union-attr]


async def test_a_fetch_that_fails_holds_nothing(tmp_path: Path) -> None:
    served = _checkpoint(tmp_path / "served")
    uses = Uses()
    with pytest.raises(ConfigError):  # a manifest that is not the pin's
        await local_init(_job(tmp_path, "3" * 64), _Scheduler(served).fetch, tmp_path, uses, "j")
    assert uses.held("j") == []
    # nothing held it: a second fetch's room-making may take the use file exclusively
    fd = os.open(use_file(tmp_path / "locks", "init", "3" * 64), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


async def test_a_checkpoint_the_disk_cannot_hold_is_refused_before_its_files_are_fetched(
    tmp_path: Path,
) -> None:
    """Room was made where unused checkpoints could go, and the fetch started whether or not
    that left enough: it filled the disk and died of it, an `OSError` mid-file (a review found
    it). Now the peer says there is no room, and fetches nothing past the manifest."""
    served = _checkpoint(tmp_path / "served")
    (served / "model.safetensors").write_bytes(bytes(1 << 20))  # 1 MiB on a 256 KiB disk
    pin = digest(manifest_of(served))
    scheduler, cache = _Scheduler(served), tmp_path / "cache"
    refused = pytest.raises(ConfigError, match=r"no room under .* for init .*GB more needed")
    with tiny_disk(cache), refused:
        await local_init(_job(tmp_path, pin), scheduler.fetch, cache, Uses(), "j")
    assert scheduler.asked == [("", 0)]  # its manifest alone
