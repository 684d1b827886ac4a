"""The in-process scheduler harness (`tests.support.scheduled`) fails a test whose cancelled job
outlives the teardown's wait, with what its task was awaiting: it once waited 60 s in silence
(tests/scheduler/test_ended_announcement.py took 65 s in one CI run, cause unknown)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.support import scheduled
from tests.support.scheduled import scheduled_swarm


async def _stuck_here() -> None:
    await asyncio.sleep(3600)


async def _never_ends() -> None:
    await _stuck_here()


async def test_a_job_task_that_outlives_the_teardowns_wait_fails_the_test_with_its_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scheduled, "CANCEL_WAIT_S", 0.2)
    with pytest.raises(AssertionError, match=r"1 cancelled job task\(s\) still ran 0.2 s") as err:
        async with scheduled_swarm(tmp_path) as swarm:
            swarm.scheduler._tasks["stuck"] = asyncio.create_task(_never_ends())
    assert "in _stuck_here" in str(err.value)  # where it was stuck, not only what it ran


async def test_a_teardown_whose_jobs_end_passes(tmp_path: Path) -> None:
    async with scheduled_swarm(tmp_path) as swarm:
        swarm.scheduler._tasks["done"] = asyncio.create_task(asyncio.sleep(0))
