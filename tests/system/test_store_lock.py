"""Two schedulers on one job store, with real processes: the second is refused while the first
still holds the store (it does not wait for it: the lock is taken without blocking, which
tests/scheduler/test_store_lock.py proves in one process, where a blocking lock would hang),
naming the store, the pid of the scheduler holding it and `--store`; once the first stops, the
store is free again."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.local.procs import start_process
from tests.support.cli import swarm


@pytest.mark.slow
def test_a_second_scheduler_on_the_same_store_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    store = tmp_path / "swarm-jobs.sqlite"
    args = ["scheduler", "--data-root", str(data), "--port", "0", "--store", str(store)]
    args += ["--checkpoint-dir", str(tmp_path / "checkpoints")]
    first = start_process(args, log_dir=tmp_path, name="first")
    try:
        first.wait_ready(120)
        second = swarm(*args, timeout=60, check=False)
        assert first.proc.poll() is None, "the first scheduler stopped: the refusal proves nothing"
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        assert lines[0].startswith(f"swarm scheduler: error: the job store {store} is in use"), (
            lines[0]
        )
        assert f"by another scheduler (pid {first.proc.pid})" in lines[0], lines[0]
        assert "give this one another store (--store PATH, SWARM_STORE)" in lines[0], lines[0]
    finally:
        assert first.stop() == 0, first.log()[-3000:]
    # Stopped, it lets go: a scheduler starts on the store again.
    again = start_process(args, log_dir=tmp_path, name="again")
    try:
        again.wait_ready(120)
    finally:
        again.stop()
