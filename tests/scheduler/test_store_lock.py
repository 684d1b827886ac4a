"""`hold`: one process holds a job store; another holder is refused with the store, the pid
holding it and the flag. With processes: tests/system/test_store_lock.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scheduler.store_file import StoreError, hold


def test_a_held_store_refuses_a_second_holder_until_let_go(tmp_path: Path) -> None:
    store = tmp_path / "jobs.sqlite"
    with hold(store):
        with pytest.raises(StoreError) as caught, hold(store):
            pass
        assert str(caught.value) == (
            f"the job store {store} is in use by another scheduler (pid {os.getpid()}): stop it, "
            "or give this one another store (--store PATH, SWARM_STORE)"
        )
    with hold(store):  # let go: held again
        pass


def test_a_store_whose_directory_is_missing_is_named(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="cannot lock the job store"), hold(tmp_path / "no" / "s"):
        pass
