"""The retention of finished jobs alone (no scheduler): the most recently ended are kept, the rest
deleted, files first; a job still shutting down waits for a later sweep; a failed deletion is
logged and the sweep goes on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler.retention import Retention
from scheduler.store import JobState, JobStore


@pytest.fixture
def store(tmp_path: Path) -> Iterator[JobStore]:
    now = [1000.0]

    def clock() -> float:
        now[0] += 1  # every write later than the one before: a strict order of ends
        return now[0]

    with JobStore(tmp_path / "jobs.db", clock=clock) as s:
        yield s


def _ended(store: JobStore, state: JobState = "succeeded") -> str:
    job_id = store.create("done", "spec", "/", 3).id
    for now in ("placing", "running", state) if state == "succeeded" else (state,):
        store.set_state(job_id, now)  # type: ignore[arg-type]
    return job_id


def _ids(store: JobStore) -> set[str]:
    return {r.id for r in store.list()}


async def test_the_most_recently_ended_are_kept_and_the_rest_deleted_files_first(
    store: JobStore,
) -> None:
    old, live = _ended(store, "failed"), store.create("live", "", "/", 3).id
    recent = _ended(store, "cancelled")
    deleted: list[tuple[str, bool]] = []

    async def delete(job_id: str) -> None:
        deleted.append((job_id, store.get(job_id) is not None))  # its record still there

    await Retention(store, 1, shutting_down=lambda _: False, delete=delete).sweep()
    assert deleted == [(old, True)]
    assert _ids(store) == {live, recent}  # an unfinished job is never swept


async def test_without_a_bound_every_finished_job_is_kept(store: JobStore) -> None:
    jobs = {_ended(store) for _ in range(3)}

    async def delete(job_id: str) -> None:
        raise AssertionError(f"{job_id} deleted")

    await Retention(store, None, shutting_down=lambda _: False, delete=delete).sweep()
    assert _ids(store) == jobs


async def test_a_job_still_shutting_down_waits_for_a_later_sweep(store: JobStore) -> None:
    writing, kept = _ended(store), _ended(store)
    busy = {writing}

    async def delete(job_id: str) -> None:
        pass

    retention = Retention(store, 1, shutting_down=busy.__contains__, delete=delete)
    await retention.sweep()
    assert _ids(store) == {writing, kept}
    busy.clear()  # its write ended: its own end sweeps again
    await retention.sweep()
    assert _ids(store) == {kept}


async def test_a_failed_deletion_is_logged_and_the_sweep_goes_on(
    store: JobStore, caplog: pytest.LogCaptureFixture
) -> None:
    stuck, gone, kept = _ended(store), _ended(store), _ended(store)

    async def delete(job_id: str) -> None:
        if job_id == stuck:
            raise OSError("permission denied")

    await Retention(store, 1, shutting_down=lambda _: False, delete=delete).sweep()
    assert _ids(store) == {stuck, kept}  # its record stays: the next sweep tries again
    assert f"job {stuck}: not deleted (retention)" in caplog.text
    assert gone not in _ids(store)
