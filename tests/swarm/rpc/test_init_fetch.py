"""A starting checkpoint not on this machine (`swarm.rpc.init_fetch.local_init`): fetched file by
file into `<cache>/init/<pin>/`, once; the manifest first, checked against the pin; a broken
stream resumed; a manifest naming a path outside the directory, or a file that is not its
manifest's, refused with nothing left under the final name."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from swarm.errors import ConfigError, PeerUnavailable
from swarm.job.config import JobConfig
from swarm.job.manifest import digest, encode, manifest_of
from swarm.rpc.init_fetch import local_init
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
    got = await local_init(_job(tmp_path, pin), scheduler.fetch, cache)
    kept = cache / "init" / pin
    assert got.model.init_from == kept and digest(manifest_of(kept)) == pin  # every file, whole
    assert ("model.safetensors", 1000) in scheduler.asked  # the broken stream went on
    assert sorted(p.name for p in (cache / "init").iterdir()) == [pin]  # no partial, no manifest
    asked = len(scheduler.asked)
    again = await local_init(_job(tmp_path, pin), scheduler.fetch, cache)
    assert again.model.init_from == kept and len(scheduler.asked) == asked  # kept: none asked


async def test_a_checkpoint_on_this_machine_is_read_there(tmp_path: Path) -> None:
    served = _checkpoint(tmp_path / "served")
    job = _job(tmp_path, digest(manifest_of(served)))
    job = replace(job, model=replace(job.model, init_from=served))
    scheduler = _Scheduler(served)
    assert (await local_init(job, scheduler.fetch, tmp_path / "cache")) == job
    assert scheduler.asked == []


async def test_a_manifest_naming_a_path_outside_the_directory_is_refused(tmp_path: Path) -> None:
    served = _checkpoint(tmp_path / "served")
    evil = json.dumps({"files": [["../../escape", 5, "0" * 64]]}, separators=(",", ":")).encode()
    pin = hashlib.sha256(evil).hexdigest()  # a scheduler that pinned it too
    scheduler = _Scheduler(served, manifest=evil)
    with pytest.raises(ConfigError, match=r"'\.\./\.\./escape': refused"):
        await local_init(_job(tmp_path, pin), scheduler.fetch, tmp_path / "cache")
    assert scheduler.asked == [("", 0)]  # no file asked for
    assert not (tmp_path / "escape").exists() and not (tmp_path / "cache" / "init" / pin).exists()


async def test_a_file_that_is_not_its_manifests_is_refused_and_removed(tmp_path: Path) -> None:
    served = _checkpoint(tmp_path / "served")
    pin = digest(manifest_of(served))
    scheduler = _Scheduler(served)
    (served / "config.json").write_text('{"num_hidden_layers": 4}')  # changed after the pin
    with pytest.raises(ConfigError, match=r"config\.json fetched from the scheduler has sha256"):
        await local_init(_job(tmp_path, pin), scheduler.fetch, tmp_path / "cache")
    kept = tmp_path / "cache" / "init" / pin
    assert not kept.exists()  # never whole under its name
    staging = kept.parent / f"{pin}.partial"
    assert not (staging / "config.json").exists() and not (staging / "config.json.partial").exists()


async def test_a_manifest_that_is_not_the_pinned_one_is_refused(tmp_path: Path) -> None:
    served = _checkpoint(tmp_path / "served")
    scheduler = _Scheduler(served)
    with pytest.raises(ConfigError, match=r"not the .* pinned at submit"):
        await local_init(_job(tmp_path, "2" * 64), scheduler.fetch, tmp_path / "cache")
    assert scheduler.asked == [("", 0)]


async def test_two_fetchers_of_one_machine_fetch_it_once(tmp_path: Path) -> None:
    served = _checkpoint(tmp_path / "served")
    job, scheduler = _job(tmp_path, digest(manifest_of(served))), _Scheduler(served)
    cache = tmp_path / "cache"
    first, second = await asyncio.gather(
        local_init(job, scheduler.fetch, cache), local_init(job, scheduler.fetch, cache)
    )
    assert first == second and scheduler.asked.count(("", 0)) == 1  # the second waited
