"""Work done once per pytest run, whichever of the run's xdist workers asks first: a module's
fixture runs in each worker that gets one of the module's tests, and `make test`'s two workers
used to build the container image twice and run the device check's quick run twice (each ~90 s
of a 2-core machine), as the tests of one module were dealt to both."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

__all__ = ["once", "once_first"]


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


def once_first(items: Sequence[pytest.Item], fixtures: Sequence[str]) -> list[pytest.Item]:
    """The suite's order, but the first asker of each of `fixtures` (fixtures that do their
    work `once`, and whose other askers only read what it left) at the front and its other
    askers at the end. Why: `make test` deals one test at a time to whichever worker is free,
    in this order. In a module's own order the second asker went to the other worker while the
    first still did the work (the device check's quick run, ~60 s), and that worker waited on
    the lock all that time (49.6 s in a CI run) with half a core idle. At the end the readers
    find the work done; at the front the long work overlaps the short tests, where a greedy
    dealing places a long test best."""
    first: list[pytest.Item] = []
    rest: list[pytest.Item] = []
    later: list[pytest.Item] = []
    asked: set[str] = set()
    for item in items:
        wants = {name for name in fixtures if name in getattr(item, "fixturenames", ())}
        if not wants:
            rest.append(item)
        elif wants <= asked:
            later.append(item)
        else:
            asked |= wants
            first.append(item)
    return first + rest + later
