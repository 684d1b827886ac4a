"""What holds a job's data or a swarm's secrets is its owner's only, whatever the umask (N20):
the job store with its -wal, -shm and lock files, the checkpoint directories and files, the spill
directory and file, the CA and the certificates and keys `swarm certs` writes."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from scheduler.store_file import hold, open_store, transaction
from stage_server.averaging.spill import Spill
from swarm.model.checkpoint import save_file, save_stage, seal
from swarm.net.certs import init_ca, issue

pytestmark = pytest.mark.attack("N20")


@pytest.fixture(autouse=True)
def _default_umask() -> Iterator[None]:
    old = os.umask(0o022)  # the usual default: files 0644, directories 0755
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _assert_private(paths: list[Path]) -> None:
    modes = {str(p): oct(_mode(p)) for p in paths}
    want = {str(p): oct(0o700 if p.is_dir() else 0o600) for p in paths}
    assert modes == want


def test_the_job_store_and_its_wal_shm_and_lock_are_the_owners_only(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite"
    with hold(path):
        db = open_store(path)
        with transaction(db):
            db.execute("PRAGMA user_version")
        files = [path, *(path.with_name(path.name + s) for s in ("-wal", "-shm", ".lock"))]
        _assert_private(files)
        db.close()


def test_checkpoints_are_the_owners_only(tmp_path: Path) -> None:
    root = tmp_path / "data" / "job" / "checkpoints"
    save_stage(root, 3, 0, {"w": torch.ones(4)})
    seal(root, 3, 1)
    save_file(tmp_path / "data" / "job" / "final" / "model.pt", {"w": torch.ones(1)}, "model")
    made = sorted((tmp_path / "data").rglob("*"))
    assert len(made) == 7  # job, checkpoints, step dir, stage file, manifest, final, model.pt
    _assert_private([tmp_path / "data", *made])


def test_a_spill_directory_it_creates_and_its_file_are_the_owners_only(tmp_path: Path) -> None:
    directory = tmp_path / "spill" / "here"
    spill = Spill(torch.randn(64), directory)
    spill.keep(slice(0, 8))
    assert spill._file is not None  # on disk, not in memory
    assert stat.S_IMODE(os.fstat(spill._file).st_mode) == 0o600
    _assert_private([tmp_path / "spill", directory])
    spill.close()


def test_certs_and_keys_are_the_owners_only(tmp_path: Path) -> None:
    directory = tmp_path / "certs"
    init_ca(directory)
    issue(directory, "node", ["127.0.0.1"])
    _assert_private([directory, *directory.iterdir()])
    assert len(list(directory.iterdir())) == 4
