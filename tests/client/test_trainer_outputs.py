"""`swarm trainer --stage-servers ...` opens what it writes before it trains: an `--out`,
`--log` or `--routes` it cannot write is a one-line error at once, not a traceback after the
training (the trained model, held only in memory, lost with it). A model it writes goes
through a temporary file, so a failed write leaves no partial file under the name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import client.standalone as standalone
import swarm.ops.model_out as model_out
from swarm.cli import main
from tests.support.jobs import write_job


@pytest.fixture
def trained(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Each training run's keywords, where the run stands in for hours of training."""
    runs: list[dict[str, Any]] = []

    async def train(job: Any, replicas: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        runs.append(kwargs)
        return {"w": torch.arange(3.0)}

    monkeypatch.setattr(standalone, "train_standalone", train)
    return runs


def _trainer(tmp_path: Path, *flags: str) -> int:
    job = write_job(tmp_path, "t", training={"stages": 1})
    argv = ["trainer", "--job", str(job), "--stage-servers", "127.0.0.1:1"]
    return main([*argv, *flags])


@pytest.mark.parametrize("flag", ["--out", "--log", "--routes"])
def test_an_output_it_cannot_write_is_refused_before_training(
    flag: str, tmp_path: Path, trained: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing" / "file"
    code = _trainer(tmp_path, flag, str(missing))
    err = capsys.readouterr().err
    assert code == 2 and trained == [], err
    assert f"swarm trainer: error: {flag} {missing}: cannot write it (" in err, err
    assert "Traceback" not in err and not missing.parent.exists()


def test_the_model_is_written_whole_under_its_name(
    tmp_path: Path, trained: list[dict[str, Any]]
) -> None:
    out = tmp_path / "model.pt"
    assert _trainer(tmp_path, "--out", str(out)) == 0 and len(trained) == 1
    assert torch.equal(torch.load(out)["w"], torch.arange(3.0))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_model_it_cannot_finish_writing_leaves_no_file_and_says_why(
    tmp_path: Path,
    trained: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def full(state: object, f: object) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", full)  # the disk filled as it wrote
    out = tmp_path / "model.pt"
    code = _trainer(tmp_path, "--out", str(out))
    err = capsys.readouterr().err
    assert code == 2 and len(trained) == 1, err
    assert f"swarm trainer: error: --out {out}: cannot write it (" in err and "pos 64" in err
    assert [p.name for p in tmp_path.iterdir() if "model" in p.name] == [], "a partial file"


def test_an_out_that_is_a_directory_is_refused_before_training(
    tmp_path: Path, trained: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.pt"
    out.mkdir()  # its temporary file could be written, its name never replaced
    code = _trainer(tmp_path, "--out", str(out))
    err = capsys.readouterr().err
    assert code == 2 and trained == [], err
    assert f"--out {out}: cannot write it (a directory)" in err, err


def test_a_model_written_whole_whose_rename_fails_is_kept_and_named(
    tmp_path: Path,
    trained: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The rename failed (another user's file in a sticky directory, say) after the model was
    # written whole, and the temporary file, its only copy, was removed with it.
    def refused(src: object, dst: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(model_out.os, "replace", refused)  # where the model is placed
    out = tmp_path / "model.pt"
    code = _trainer(tmp_path, "--out", str(out))
    err = capsys.readouterr().err
    kept = tmp_path / ".model.pt.partial"
    assert code == 2 and f"the model is kept at {kept}" in err, err
    assert torch.equal(torch.load(kept)["w"], torch.arange(3.0))
