"""Work done once per pytest run, whichever of the run's xdist workers asks first: a module's
fixture runs in each worker that gets one of the module's tests, and `make test`'s two workers
used to build the container image twice and run the device check's quick run twice (each ~90 s
of a 2-core machine), as the tests of one module were dealt to both."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["once"]


def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of this pytest run's own, the same for each of its xdist workers (each has a
    base temp folder of its own inside the run's)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def once(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[tuple[Path, bool]]:
    """(`name`'s folder in the run's, whether the work is to be done here): the first worker to
    ask does it while it holds the folder's lock; the others wait on the lock, then use what it
    left in the folder. Work that raised is not marked done: the next to ask does it again, and
    fails with its own error."""
    folder = run_folder(tmp_path_factory) / f"once-{name}"
    folder.mkdir(parents=True, exist_ok=True)
    done = folder / "done"
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
        first = not done.exists()
        yield folder, first
        done.touch()
