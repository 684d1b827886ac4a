"""Checkpoints: the format, and export from one when no replica is alive."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from scheduler.coordinator.recovery import Recovery
from scheduler.coordinator.replicas import ReplicaClients, grpc_replicas
from scheduler.service import Scheduler, SchedulerOptions
from scheduler.store import JobStore
from stage_server.replica.runtime import StageRuntime
from swarm.job.config import JobConfig
from swarm.model import checkpoint
from tests.support.disks import fill, tiny_disk
from tests.support.fakes import NoBus  # export never touches the bus
from tests.support.jobs import BASE, make_job, render


def _save(root: Path, job, step: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    model = {}
    for stage in range(job.training.stages):
        state = StageRuntime(job, stage).export_state()
        checkpoint.save_stage(root, step, stage, state)
        model.update(
            {k.removeprefix("param/"): v for k, v in state.items() if k.startswith("param/")}
        )
    return model


def _sealed(tmp_path: Path, *steps: int) -> tuple[JobConfig, Path]:
    """A job and its checkpoints of `steps`, each sealed."""
    job, root = make_job(tmp_path), tmp_path / "ckpt"
    for step in steps:
        _save(root, job, step)
        checkpoint.seal(root, step, job.training.stages)
    return job, root


def test_only_sealed_checkpoints_count(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    assert checkpoint.latest(tmp_path / "ckpt") is None
    _save(tmp_path / "ckpt", job, 4)
    assert checkpoint.latest(tmp_path / "ckpt") is None  # stage files without a manifest
    checkpoint.seal(tmp_path / "ckpt", 4, job.training.stages)
    _save(tmp_path / "ckpt", job, 6)  # a newer one, torn: never sealed
    assert checkpoint.latest(tmp_path / "ckpt") == 4


def test_a_checkpoint_that_cannot_be_read_is_said_and_a_bans_rollback_drops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A manifest whose read fails (EIO, EACCES on a volume of another owner) was passed over
    unsaid: a rollback went further back, saying "no checkpoint", and a ban's rollback left the
    newer checkpoint, which holds the banned peer's work, for a later `latest` to pick once its
    disk read again."""
    _, root = _sealed(tmp_path, 1, 2)
    unreadable = root / "step-00000002" / "manifest.json"
    read_text = Path.read_text

    def failing(path: Path, *args: object, **kwargs: object) -> str:
        if path == unreadable:
            raise OSError(errno.EIO, "Input/output error", str(path))
        return read_text(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", failing)
    assert checkpoint.latest(root) == 1
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("step-00000002" in m and "Input/output error" in m for m in said), said
    assert checkpoint.drop_after(root, 1) == [2]  # a ban's rollback to step 1
    assert not (root / "step-00000002").exists()
    monkeypatch.setattr(Path, "read_text", read_text)  # the disk reads again
    assert checkpoint.latest(root) == 1


async def test_a_bans_checkpoint_the_disk_keeps_fails_no_rollback_and_is_never_gone_back_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its manifest could not be deleted (a read-only disk, another owner's directory): the
    ban's rollback raised, and the job failed. It goes on now to the step before, said at
    ERROR, and the checkpoint kept, the banned peer's work, is never gone back to after."""
    job, root = _sealed(tmp_path, 1, 2)
    kept = root / "step-00000002" / "manifest.json"
    unlink = Path.unlink

    def refused(path: Path, missing_ok: bool = False) -> None:
        if path == kept:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refused)
    recovery = Recovery(job, ReplicaClients(grpc_replicas(job, "job")), root)
    assert await recovery.back_before(1) == 1
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("step-00000002" in m and "Permission denied" in m for m in said), said
    assert checkpoint.latest(root) == 2  # still there, sealed: but never this job's again
    assert recovery.latest() == 1 and await recovery.back_before(5) == 1


async def test_export_falls_back_to_the_last_checkpoint(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    with JobStore(tmp_path / "jobs.sqlite") as store:
        record = store.create("test", render(BASE), str(tmp_path), job.training.steps)
        scheduler = Scheduler(store, NoBus(), SchedulerOptions(tmp_path / "ckpt"))  # type: ignore[arg-type]
        model = _save(tmp_path / "ckpt" / record.id, job, 2)
        checkpoint.seal(tmp_path / "ckpt" / record.id, 2, job.training.stages)
        step, state = await scheduler.export(record.id)  # no coordinator, no replica alive
    assert step == 2 and state.keys() == model.keys()
    assert all(torch.equal(state[k], model[k]) for k in model)


def test_a_full_disk_fails_a_checkpoint_write_as_oserror_and_leaves_no_partial_file(
    tmp_path: Path,
) -> None:
    job = make_job(tmp_path)
    state = StageRuntime(job, 0).export_state()
    with tiny_disk(tmp_path / "disk", "1m") as disk:
        root = disk / "ckpt"
        checkpoint.save_stage(root, 2, 0, state)  # room enough: a file, no leftovers
        filler = fill(disk)
        with pytest.raises(OSError) as e:
            checkpoint.save_stage(root, 4, 0, state)
        assert isinstance(e.value, checkpoint.CheckpointError) and "step 4" in str(e.value)
        with pytest.raises(checkpoint.CheckpointError):
            checkpoint.seal(root, 2, 1)
        assert not [p for p in disk.rglob("*") if ".tmp" in p.name]  # partial files removed
        assert checkpoint.latest(root) is None
        filler.unlink()
        checkpoint.save_stage(root, 4, 0, state)  # room again: it works
        checkpoint.seal(root, 4, 1)
        assert checkpoint.latest(root) == 4
        loaded = checkpoint.load_stage(root, 4, 0)
        assert all(torch.equal(loaded[k], v) for k, v in state.items())
        assert sorted(p.name for p in disk.rglob("*") if p.is_file()) == [
            "manifest.json",
            "stage-0.safetensors",
            "stage-0.safetensors",
        ]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_state_with_non_finite_values_is_never_written(tmp_path: Path, bad: float) -> None:
    job = make_job(tmp_path)
    state = StageRuntime(job, 0).export_state()
    name = next(k for k, v in state.items() if k.startswith("param/") and v.is_floating_point())
    state[name].view(-1)[3] = bad
    with pytest.raises(checkpoint.CheckpointError, match=rf"{name}.*NaN or infinite"):
        checkpoint.save_stage(tmp_path / "ckpt", 2, 0, state)
    assert not list((tmp_path / "ckpt").rglob("*stage-*"))  # no file, not even a partial one


def test_pruning_keeps_the_newest_sealed_checkpoints_and_one_being_written(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    root = tmp_path / "ckpt"
    for step in (2, 4, 6, 8):
        _save(root, job, step)
        checkpoint.seal(root, step, job.training.stages)
    _save(root, job, 10)  # being written: no manifest yet
    assert checkpoint.prune(root, keep=2) == [2, 4]
    assert checkpoint.sealed(root) == [6, 8] and (root / "step-00000010").exists()
    assert checkpoint.prune(root, keep=1) == [6] and checkpoint.sealed(root) == [8]
    with pytest.raises(ValueError, match="keep"):  # the newest sealed one is never deleted
        checkpoint.prune(root, keep=0)
    assert checkpoint.sealed(root) == [8]


def test_a_stage_file_is_written_as_it_comes_and_read_back_bit_for_bit(tmp_path: Path) -> None:
    """Every dtype a state holds (0-dim, bfloat16, bool, an empty tensor), in a header that
    outgrows the room kept for it (no tensor was announced) as in one that fits."""
    state = {
        "param/w": torch.randn(3, 5, dtype=torch.float64),
        "param/h": torch.randn(7).to(torch.bfloat16),
        "optim/0/step": torch.tensor(3.0),
        "optim/0/mask": torch.tensor([True, False, True]),
        "optim/0/ids": torch.arange(5, dtype=torch.int64)[1::2],  # not contiguous
        "optim/0/empty": torch.zeros(0, 4),
    }
    many = {f"param/{'x' * 200}{i}": torch.full((2,), float(i)) for i in range(40)}
    for step, (tensors, expected) in enumerate([(6, state), (0, many), (len(many), many)], 1):
        writer = checkpoint.StageWriter(tmp_path, step, 0, tensors=tensors)
        for name, tensor in expected.items():
            writer.add(name, tensor)
        writer.close()
        back = checkpoint.load_stage(tmp_path, step, 0)
        assert back.keys() == expected.keys()
        for name, tensor in expected.items():
            assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]


def test_a_stage_writer_refuses_a_non_finite_tensor_and_abort_leaves_nothing(
    tmp_path: Path,
) -> None:
    writer = checkpoint.StageWriter(tmp_path, 2, 1, tensors=2)
    writer.add("param/a", torch.ones(4))
    with pytest.raises(checkpoint.CheckpointError, match="param/b holds NaN"):
        writer.add("param/b", torch.tensor([1.0, float("nan")]))
    writer.abort()
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_a_checkpoint_of_the_torch_save_format_is_still_read(tmp_path: Path) -> None:
    state = {"param/w": torch.randn(4, 4), "optim/0/step": torch.tensor(2.0)}
    (tmp_path / "step-00000003").mkdir()
    torch.save(state, tmp_path / "step-00000003" / "stage-0.pt")
    back = checkpoint.load_stage(tmp_path, 3, 0)
    assert all(torch.equal(back[k], v) for k, v in state.items()) and back.keys() == state.keys()


@pytest.mark.parametrize("text", ["[1, 2]", "7", '{"step": null}', "not json", "{}"])
def test_a_foreign_manifest_is_no_checkpoint(tmp_path: Path, text: str) -> None:
    """Whatever else wrote a manifest into the job's checkpoint folder: passed over. A list, a
    number or a null step raised TypeError, out of every stall watch's look at the job's last
    checkpoint and each attempt's start, so the job's attempts kept failing."""
    _, root = _sealed(tmp_path, 1)
    (root / "step-00000009").mkdir()
    (root / "step-00000009" / "manifest.json").write_text(text)
    assert checkpoint.sealed(root) == [1]
