"""`swarm local` opens what it writes before it trains, as `swarm trainer` does
(tests/client/test_trainer_outputs.py): an `--out` or `--log` it cannot write, or an `--format
hf` directory that is not empty, is a one-line error at once, not a traceback after the
training with the trained model (held only in memory) lost. The model goes through a temporary
file: a failed write leaves a previous model as it was (torch.save truncated it first). A
`--log` that fails mid-run (a full disk) is said once and training goes on."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import swarm.model.reference as reference
from swarm.cli import main
from swarm.model.transformer import build_model
from swarm.ops import progress
from swarm.ops.progress import StepRecord
from tests.support.disks import fill, tiny_disk
from tests.support.jobs import write_job


@pytest.fixture
def trained(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each training run, where the run stands in for hours of training: two steps logged."""
    runs: list[int] = []

    def train(job: Any, device: Any, on_step: Any = None, **_: Any) -> torch.nn.Module:
        runs.append(1)
        for step in range(2):
            on_step(StepRecord(step=step, loss=1.0, samples=4, seconds=0.1))
        return torch.nn.Linear(2, 1)

    monkeypatch.setattr(reference, "train_local", train)
    return runs


def _local(tmp_path: Path, *flags: str) -> int:
    job = write_job(tmp_path, "l", training={"stages": 1, "steps": 2})
    return main(["local", str(job), "--threads", "1", *flags])


@pytest.mark.parametrize("flag", ["--out", "--log"])
def test_an_output_it_cannot_write_is_refused_before_training(
    flag: str, tmp_path: Path, trained: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing" / "file"
    code = _local(tmp_path, flag, str(missing))
    err = capsys.readouterr().err
    assert code == 2 and trained == [], err
    assert f"{flag} {missing}: cannot write it (" in err and "Traceback" not in err, err


def test_an_hf_directory_that_is_not_empty_is_refused_before_training(
    tmp_path: Path, trained: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "theirs.txt").write_text("kept")
    code = _local(tmp_path, "--out", str(out), "--format", "hf")
    err = capsys.readouterr().err
    assert code == 2 and trained == [], err
    assert "is not an empty directory" in err and "Traceback" not in err, err
    assert (out / "theirs.txt").read_text() == "kept"


def test_a_model_it_cannot_write_leaves_the_previous_one_whole(
    tmp_path: Path,
    trained: list[int],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "model.pt"
    out.write_bytes(b"yesterday's model")
    real = torch.save

    def full(state: object, f: Any) -> None:
        f.write(b"half")  # the disk filled as it wrote
        raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", full)
    code = _local(tmp_path, "--out", str(out))
    err = capsys.readouterr().err
    assert code == 2 and trained == [1], err
    assert f"--out {out}: cannot write it (" in err and "Traceback" not in err, err
    assert out.read_bytes() == b"yesterday's model"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    monkeypatch.setattr(torch, "save", real)
    assert _local(tmp_path, "--out", str(out)) == 0
    assert "weight" in torch.load(out, weights_only=True)


def test_a_log_that_fails_mid_run_is_said_and_training_goes_on(
    tmp_path: Path,
    trained: list[int],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Full:
        def __init__(self, *_: Any) -> None:
            self.lines = 0

        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setattr(progress, "open", Full, raising=False)  # StepLog's file, full at once
    out = tmp_path / "model.pt"
    assert _local(tmp_path, "--log", str(tmp_path / "log.jsonl"), "--out", str(out)) == 0
    assert out.exists() and trained == [1]
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(said) == 1 and "No space left" in said[0], said


def test_an_hf_directory_it_cannot_make_is_refused_before_training(
    tmp_path: Path, trained: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    """Its parent a file (or a directory it may not write in): the model, trained, was lost to
    a traceback as `write_hf` made its directory (a review found it)."""
    (tmp_path / "afile").write_text("not a directory")
    out = tmp_path / "afile" / "hf"
    code = _local(tmp_path, "--out", str(out), "--format", "hf")
    err = capsys.readouterr().err
    assert code == 2 and trained == [], err
    assert f"--out {out}:" in err and "Traceback" not in err, err


def test_an_hf_model_the_disk_cannot_hold_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The disk fills as the weights are written: safetensors' own error was a traceback (a
    review found it); it is said in one line, and nothing half written is left."""

    def train(job: Any, device: Any, on_step: Any = None, **_: Any) -> torch.nn.Module:
        return build_model(job)

    monkeypatch.setattr(reference, "train_local", train)
    with tiny_disk(tmp_path / "disk") as disk:
        filler = fill(disk)
        os.truncate(filler, filler.stat().st_size - 16384)  # room for config.json, not weights
        out = disk / "hf"
        code = _local(tmp_path, "--out", str(out), "--format", "hf")
        err = capsys.readouterr().err
        assert code == 2, err
        assert f"--out {out}: cannot write it (No space left on device)" in err, err
        assert "Traceback" not in err, err
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]
