"""A checkpoint directory's manifest (`swarm.job.manifest`): every file as (path, size, sha256),
sorted, its sha256 the pin; and a manifest fetched from elsewhere is refused when it does not
match the pin or names a path outside the directory it is fetched into."""

from __future__ import annotations

import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from swarm.errors import ConfigError
from swarm.job import manifest
from swarm.job.manifest import Entry, digest, encode, manifest_of, parse, path_problem


def _checkpoint(directory: Path) -> Path:
    (directory / "tokenizer").mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"weights" * 100)
    (directory / "config.json").write_text('{"num_hidden_layers": 2}')
    (directory / "tokenizer" / "vocab.json").write_text("{}")
    return directory


def _pinned(rows: list[list[object]]) -> tuple[bytes, str]:
    """A manifest's bytes as a scheduler might serve them, and the pin that matches them."""
    data = json.dumps({"files": rows}, separators=(",", ":")).encode()
    return data, hashlib.sha256(data).hexdigest()


def test_the_manifest_lists_every_file_sorted_and_its_digest_is_the_pin(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    entries = manifest_of(ckpt)
    assert [e.path for e in entries] == ["config.json", "model.safetensors", "tokenizer/vocab.json"]
    weights = (ckpt / "model.safetensors").read_bytes()
    assert entries[1] == Entry(
        "model.safetensors", len(weights), hashlib.sha256(weights).hexdigest()
    )
    pin = digest(entries)
    assert pin == hashlib.sha256(encode(entries)).hexdigest()
    assert parse(encode(entries), pin) == entries  # what a fetcher reads back
    (ckpt / "config.json").write_text('{"num_hidden_layers": 4}')  # the config counts too
    assert digest(manifest_of(ckpt)) != pin


def test_a_link_to_a_file_counts_as_the_file_and_a_link_to_a_folder_is_refused(
    tmp_path: Path,
) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / "abc").write_bytes(b"weights" * 100)
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").symlink_to(blobs / "abc")  # as a Hugging Face cache keeps it
    assert manifest_of(ckpt) == manifest_of(_checkpoint(tmp_path / "plain"))
    (ckpt / "more").symlink_to(blobs)
    with pytest.raises(ConfigError, match="is a link to a directory"):
        manifest_of(ckpt)


@pytest.mark.parametrize(
    "path", ["../escape", "/etc/passwd", "a/../../b", "a//b", "./a", "", "a\\..\\b", "a/."]
)
def test_a_manifest_naming_a_path_outside_its_directory_is_refused(path: str) -> None:
    assert path_problem(path) is not None
    data, pin = _pinned([[path, 1, "0" * 64]])
    with pytest.raises(ConfigError, match="refused"):
        parse(data, pin)


def test_a_manifest_that_is_not_the_pinned_one_is_refused_naming_both(tmp_path: Path) -> None:
    entries = manifest_of(_checkpoint(tmp_path / "ckpt"))
    other = "1" * 64
    with pytest.raises(ConfigError) as info:
        parse(encode(entries), other)
    assert other in str(info.value) and digest(entries) in str(info.value)


@pytest.mark.parametrize(
    ("rows", "why"),
    [
        ([["b", 1, "0" * 64], ["a", 1, "0" * 64]], "not sorted"),
        ([["a", 1, "0" * 64], ["a", 1, "0" * 64]], "twice"),
        ([["a", 1, "0" * 64], ["a/b", 1, "0" * 64]], "a file and a folder"),
        ([["a", -1, "0" * 64]], "bad size"),
        ([["a", 1, "XYZ"]], "bad size or sha256"),
        ([["a", 1]], "not a manifest"),
    ],
)
def test_a_malformed_manifest_is_refused(rows: list[list[object]], why: str) -> None:
    data, pin = _pinned(rows)
    with pytest.raises(ConfigError, match=why):
        parse(data, pin)


def _counting_opens(monkeypatch: pytest.MonkeyPatch, pause_s: float = 0.0) -> list[str]:
    """The files `swarm.job.manifest` opens (to hash them) from now on, each a pause long."""
    opened: list[str] = []

    def counted(path: Path, mode: str = "r") -> object:
        opened.append(str(path))
        time.sleep(pause_s)
        return open(path, mode)

    monkeypatch.setattr(manifest, "open", counted, raising=False)
    return opened


def test_a_checkpoint_of_many_files_is_hashed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # FetchInit lists a checkpoint's manifest at every call (and each file's own fetch hashes
    # it again): with 300 files, a memory of 256 hashes dropped each file before the walk came
    # back to it, and every call hashed the whole checkpoint again.
    for i in range(300):
        (tmp_path / f"shard-{i:03d}.bin").write_bytes(i.to_bytes(2, "big") * 64)
    # settled (a file changed within the ctime clock's tick is never remembered): at once here
    monkeypatch.setattr(manifest, "_RACY_NS", 0)
    opened = _counting_opens(monkeypatch)
    first = manifest_of(tmp_path)
    assert manifest_of(tmp_path) == first and len(opened) == 300, len(opened)


def test_one_file_asked_at_once_by_many_is_hashed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Eight stage servers asking a cold scheduler for the manifest at once hashed each file
    # eight times, filling the thread pool every other call waits on.
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"weights" * 1000)
    monkeypatch.setattr(manifest, "_RACY_NS", 0)  # settled at once
    opened = _counting_opens(monkeypatch, pause_s=0.3)
    with ThreadPoolExecutor(8) as pool:
        digests = set(pool.map(lambda _: manifest.file_sha256(path), range(8)))
    assert digests == {hashlib.sha256(b"weights" * 1000).hexdigest()} and len(opened) == 1


def test_a_checkpoint_of_more_files_than_a_fetcher_takes_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, the submit took it, and every fetcher then refused its manifest (`parse`).
    monkeypatch.setattr(manifest, "MAX_FILES", 3)
    for i in range(4):
        (tmp_path / f"shard-{i}.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match="holds more than 3 files"):
        manifest_of(tmp_path)
    (tmp_path / "shard-3.bin").unlink()
    assert len(manifest_of(tmp_path)) == 3
