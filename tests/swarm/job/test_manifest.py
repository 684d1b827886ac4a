"""A checkpoint directory's manifest (`swarm.job.manifest`): every file as (path, size, sha256),
sorted, its sha256 the pin; and a manifest fetched from elsewhere is refused when it does not
match the pin or names a path outside the directory it is fetched into."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from swarm.errors import ConfigError
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
