"""The SQLite job store: round trips, the state machine, idempotent steps, durability."""

from __future__ import annotations

import math
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from scheduler.store import SCHEMA_VERSION, JobState, JobStore, StoreError, StoreWriteError
from scheduler.store_file import transaction
from swarm.errors import FailedPrecondition, InvalidArgument, NotFound
from tests.support.cli import ROOT
from tests.support.disks import fill, tiny_disk
from tests.support.store_schema import as_before


@pytest.fixture
def store(tmp_path: Path) -> Iterator[JobStore]:
    with JobStore(tmp_path / "jobs.db") as s:
        yield s


def test_create_get_list(store: JobStore) -> None:
    a = store.create("tiny", "name = 'tiny'", "/data", steps=5)
    b = store.create("tiny", "spec b", "/data", steps=7)
    assert a.id.startswith("tiny-") and len(a.id) == len("tiny-") + 6 and a.id != b.id
    assert (a.state, a.step, a.steps, a.error, a.message) == ("queued", 0, 5, "", "")
    assert math.isnan(a.loss) and a.created == a.updated
    assert store.get(a.id) == a
    assert store.get("nope") is None
    assert [j.id for j in store.list()] == [b.id, a.id]  # newest first


LEGAL: list[list[JobState]] = [
    ["placing", "running", "succeeded"],
    ["placing", "running", "placing", "running", "succeeded"],  # a stage lost its replicas
    ["cancelled"],
    ["placing", "failed"],
    ["placing", "running", "cancelled"],
    ["placing", "placing", "running", "running"],  # staying put is allowed while unfinished
    # a stage without a replica while it trains, served again; or the attempt ends meanwhile
    ["placing", "running", "stalled", "stalled", "running", "succeeded"],
    ["placing", "running", "stalled", "placing", "running", "stalled", "cancelled"],
]


@pytest.mark.parametrize("path", LEGAL, ids=["-".join(p) for p in LEGAL])
def test_legal_transitions(store: JobStore, path: list[JobState]) -> None:
    job = store.create("j", "", "/", 3)
    for state in path:
        assert store.set_state(job.id, state).state == state


ILLEGAL: list[tuple[list[JobState], JobState]] = [
    ([], "running"),  # queued must be placed first
    ([], "succeeded"),
    (["placing"], "succeeded"),
    (["placing"], "queued"),
    (["placing", "running", "succeeded"], "running"),
    (["placing", "running", "succeeded"], "failed"),
    (["cancelled"], "cancelled"),  # terminal states are final
    (["failed"], "placing"),
    (["placing"], "stalled"),  # only a job that trains can stall
    (["placing", "running", "stalled", "succeeded"], "stalled"),
]


@pytest.mark.parametrize("path,bad", ILLEGAL)
def test_illegal_transitions(store: JobStore, path: list[JobState], bad: JobState) -> None:
    job = store.create("j", "", "/", 3)
    for state in path:
        store.set_state(job.id, state)
    with pytest.raises(FailedPrecondition, match=f"cannot become {bad}"):
        store.set_state(job.id, bad)
    assert store.get(job.id).state == (path[-1] if path else "queued")  # type: ignore[union-attr]


def test_error_and_message(store: JobStore) -> None:
    job = store.create("j", "", "/", 3)
    store.set_state(job.id, "placing", message="waiting for stage 1")
    store.set_message(job.id, "placing 2 peers")
    failed = store.set_state(job.id, "failed", error="stage 1 has no replica")
    assert (failed.error, failed.message) == ("stage 1 has no replica", "placing 2 peers")
    with pytest.raises(NotFound):
        store.set_state("nope", "placing")
    with pytest.raises(NotFound):
        store.set_message("nope", "x")


def test_record_step_is_idempotent(store: JobStore) -> None:
    job = store.create("j", "", "/", 3)
    assert store.record_step(job.id, 0, 2.5, 16, 0.1)
    assert not store.record_step(job.id, 0, 9.9, 16, 0.2)  # a retried report changes nothing
    assert store.record_step(job.id, 1, 2.0, 16, 0.1)
    record = store.get(job.id)
    assert record is not None and (record.step, record.loss) == (2, 2.0)
    rows = store.steps(job.id)
    assert [(r.step, r.loss, r.samples) for r in rows] == [(0, 2.5, 16), (1, 2.0, 16)]
    store.rewind(job.id, 1)  # back to the checkpoint after step 0
    record = store.get(job.id)
    assert record is not None and (record.step, record.loss) == (1, 2.5)
    assert [r.step for r in store.steps(job.id)] == [0]


def test_unfinished(store: JobStore) -> None:
    ids = [store.create(f"j{i}", "", "/", 3).id for i in range(4)]
    store.set_state(ids[1], "placing")
    store.set_state(ids[2], "cancelled")
    store.set_state(ids[3], "placing")
    store.set_state(ids[3], "running")
    assert [j.id for j in store.unfinished()] == [ids[0], ids[1], ids[3]]


def test_reopen(tmp_path: Path) -> None:
    with JobStore(tmp_path / "jobs.db") as s:
        job = s.create("j", "spec", "/d", 3)
        s.set_state(job.id, "placing")
        s.record_step(job.id, 0, 1.5, 4, 0.1)
    with JobStore(tmp_path / "jobs.db") as s:
        again = s.get(job.id)
        assert again is not None and (again.state, again.step, again.loss) == ("placing", 1, 1.5)
        assert [r.step for r in s.steps(job.id)] == [0]


_CHILD = """
import sys, time
from scheduler.store import JobStore
s = JobStore(sys.argv[1])
job = s.create("killed", "spec", "/d", 9)
s.set_state(job.id, "placing")
s.record_step(job.id, 0, 0.75, 8, 0.5)
print(job.id, flush=True)
time.sleep(60)
"""


def test_survives_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert child.stdout is not None
    job_id = child.stdout.readline().strip()
    os.kill(child.pid, signal.SIGKILL)  # no close, no checkpoint of the WAL
    child.wait()
    child.stdout.close()
    with JobStore(path) as s:
        job = s.get(job_id)
        assert job is not None and (job.state, job.step, job.loss) == ("placing", 1, 0.75)


def test_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    JobStore(path).close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(StoreError, match="newer than this swarm"):
        JobStore(path)
    (tmp_path / "junk.db").write_bytes(b"not a database at all, certainly not sqlite" * 100)
    with pytest.raises(StoreError, match="not a usable job store"):
        JobStore(tmp_path / "junk.db")


def test_resume_below_the_recorded_steps_forgets_the_lost_run(store: JobStore) -> None:
    job = store.create("j", "", "/", 9)
    for step in range(4):
        store.record_step(job.id, step, 4.0 - step, 16, 0.1)
    store.resume(job.id, 4)  # the coordinator starts where the store is: nothing to forget
    store.resume(job.id, 6)  # ahead (killed between a commit and its record): kept as is
    record = store.get(job.id)
    assert record is not None and (record.step, record.loss) == (4, 1.0)
    assert [r.step for r in store.steps(job.id)] == [0, 1, 2, 3]
    # Every replica restarted empty and no checkpoint: the coordinator starts at step 0 again.
    store.resume(job.id, 0)
    record = store.get(job.id)
    assert record is not None and record.step == 0 and math.isnan(record.loss)
    assert store.steps(job.id) == []
    assert store.record_step(job.id, 0, 3.5, 16, 0.2)  # the re-run's row, not the old one
    assert [(r.step, r.loss) for r in store.steps(job.id)] == [(0, 3.5)]
    assert store.get(job.id).step == 1  # type: ignore[union-attr]


def test_a_full_disk_fails_a_step_record_clearly_and_the_next_step_records_both(
    tmp_path: Path,
) -> None:
    with tiny_disk(tmp_path / "disk") as disk:
        with JobStore(disk / "jobs.db") as store:
            job = store.create("j", "", "/", 9)
            store.record_step(job.id, 0, 3.0, 16, 0.1)
            filler = fill(disk)
            with pytest.raises(StoreWriteError, match=r"step 1 of job .* not recorded .*full"):
                store.record_step(job.id, 1, 2.0, 16, 0.1)
            assert [r.step for r in store.steps(job.id)] == [0]  # nothing half-written
            # what the job has trained counts the held record: a start believes replicas at it
            assert (store.get(job.id).step, store.trained(job.id)) == (1, 2)  # type: ignore[union-attr]
            filler.unlink()  # room again: the next step's record writes the kept one first
            assert store.record_step(job.id, 2, 1.0, 16, 0.1)
        with JobStore(disk / "jobs.db") as store:  # and they are durable
            rows = [(r.step, r.loss) for r in store.steps(job.id)]
            assert rows == [(0, 3.0), (1, 2.0), (2, 1.0)]
            record = store.get(job.id)
            assert record is not None and (record.step, record.loss) == (3, 1.0)


def test_every_write_on_a_full_disk_raises_the_stores_error_and_changes_nothing(
    tmp_path: Path,
) -> None:
    # A state, a message, a new job, a deletion: each raised sqlite3's own error, which the
    # callers that wait a full disk out (the final save's retries) do not catch: the final
    # save ended and the job's trained state was let go, the store still saying "running".
    with tiny_disk(tmp_path / "disk") as disk, JobStore(disk / "jobs.db") as store:
        job = store.create("j", "", "/", 9)
        done = store.create("d", "", "/", 9)
        store.set_state(done.id, "cancelled")
        filler = fill(disk)
        writes = [
            lambda: store.set_state(job.id, "placing", message="placing"),
            lambda: store.set_message(job.id, "saving the final model failed"),
            lambda: store.create("k", "x" * 100_000, "/", 9),
            lambda: store.delete(done.id),
            lambda: store.rewind(job.id, 0),  # a rollback's
        ]
        for write in writes:
            with pytest.raises(StoreWriteError, match=r"full"):  # the disk's doing
                write()
        record = store.get(job.id)
        assert record is not None and (record.state, record.message) == ("queued", "")
        assert {r.id for r in store.list()} == {job.id, done.id}
        filler.unlink()
        store.set_state(job.id, "placing", message="placing")  # room again: it writes
        assert store.get(job.id).state == "placing"  # type: ignore[union-attr]


def test_a_record_carries_the_loss_of_step_0(store: JobStore) -> None:
    job = store.create("a", "spec", "/d", 5)
    assert math.isnan(job.first_loss)  # before step 0 is committed
    store.record_step(job.id, 0, 2.5, 8, 0.1)
    store.record_step(job.id, 1, 2.0, 8, 0.1)
    assert store.get(job.id).first_loss == 2.5  # type: ignore[union-attr]
    assert [r.first_loss for r in store.list()] == [2.5]
    store.rewind(job.id, 0)  # rolled back to step 0: the run's step 0 is to be trained again
    assert math.isnan(store.get(job.id).first_loss)  # type: ignore[union-attr]


def test_pages_newest_first_without_specs(store: JobStore) -> None:
    ids = [store.create("j", f"spec {k}", "/data", 3).id for k in range(5)]
    seen, cursor = [], ""
    while True:
        page, cursor = store.page(2, cursor)
        assert len(page) <= 2 and {r.spec for r in page} <= {""}
        assert all(r == replace(store.get(r.id), spec="") for r in page)  # type: ignore[arg-type]
        seen += [r.id for r in page]
        if not cursor:
            break
    assert seen == ids[::-1]
    assert store.page(5) == (store.page(10)[0], "")  # a page that holds the rest has no cursor
    for bad in ("nonsense", "0x1p+0:x", "nan:1"):
        with pytest.raises(InvalidArgument, match="page_token"):
            store.page(2, bad)


def test_delete_only_a_finished_job_and_all_its_rows(store: JobStore) -> None:
    job = store.create("j", "spec", "/data", 3).id
    other = store.create("k", "spec", "/data", 3).id
    for s in (job, other):
        store.record_step(s, 0, 2.5, 16, 0.1)
        store.record_eval(s, 1, 2.0)
    with pytest.raises(FailedPrecondition, match="is queued; cancel it first"):
        store.delete(job)
    assert store.deletions == 0  # refused: nothing deleted
    store.set_state(job, "cancelled")
    store.delete(job)
    assert store.get(job) is None and store.steps(job) == [] and store.evals(job) == []
    assert [r.id for r in store.list()] == [other] and len(store.steps(other)) == 1
    assert store.deletions == 1  # the job API's cache of jobs drops itself at it
    with pytest.raises(NotFound):
        store.delete(job)


def test_finished_beyond_keeps_the_most_recently_ended(tmp_path: Path) -> None:
    now = [1000.0]
    with JobStore(tmp_path / "jobs.db", clock=lambda: now[0]) as store:
        ids = [store.create("j", "spec", "/", 3).id for _ in range(5)]
        # ended in the order 2, 0, 3; 1 and 4 still queued
        for k, state in ((2, "failed"), (0, "cancelled"), (3, "cancelled")):
            now[0] += 1
            store.set_state(ids[k], state)  # type: ignore[arg-type]
        assert store.finished_beyond(3) == []
        assert store.finished_beyond(2) == [ids[2]]
        assert store.finished_beyond(1) == [ids[0], ids[2]]
        assert store.finished_beyond(0) == [ids[3], ids[0], ids[2]]


def test_events_are_kept_newest_bounded_and_deleted_with_the_job(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    import scheduler.store as store_module

    monkeypatch.setattr(store_module, "MAX_EVENTS", 5)
    a = store.create("tiny", "spec", "/data", steps=5).id
    b = store.create("tiny", "spec", "/data", steps=5).id
    for i in range(8):
        store.record_event(a, "join", f"p{i} joined stage 0")
    store.record_event(b, "leave", "x" * 10_000)  # a peer's words are cut, not stored whole
    assert [e.text for e in store.events(a)] == [f"p{i} joined stage 0" for i in range(3, 8)]
    assert [e.text for e in store.events(a, 2)] == ["p6 joined stage 0", "p7 joined stage 0"]
    assert all(e.kind == "join" for e in store.events(a)) and store.events(a)[0].time > 0
    assert [len(e.text) for e in store.events(b)] == [store_module.MAX_EVENT_TEXT]
    store.set_state(a, "cancelled")
    store.delete(a)
    assert store.events(a) == [] and len(store.events(b)) == 1


def _speed(store: JobStore, job: str) -> float:
    record = store.get(job)
    assert record is not None
    return record.mean_speed


def test_mean_speed_is_over_the_recorded_steps(store: JobStore) -> None:
    job = store.create("tiny", "spec", "/data", steps=5).id
    assert _speed(store, job) == 0.0
    store.record_step(job, 0, 2.0, 16, 0.5)
    store.record_step(job, 1, 1.9, 16, 1.5)
    store.record_step(job, 1, 1.9, 16, 9.0)  # a retried report: the first record stands
    assert _speed(store, job) == 16.0
    store.record_step(job, 2, 1.8, 32, 2.0)
    assert _speed(store, job) == 16.0
    store.rewind(job, 2)  # a rollback to the checkpoint after step 1: step 2 is trained again
    assert _speed(store, job) == 16.0
    store.set_state(job, "cancelled")
    (listed,), _ = store.page(10, "")  # as `swarm jobs` lists it (without its spec)
    assert listed.mean_speed == 16.0
    store.rewind(job, 0)
    assert _speed(store, job) == 0.0


def _work(store: JobStore, read: Callable[[], object]) -> int:
    """SQLite's virtual-machine instructions `read()` takes on the store's connection."""
    count = 0

    def counted() -> int:
        nonlocal count
        count += 1
        return 0  # go on

    store._db.set_progress_handler(counted, 1)
    try:
        read()
    finally:
        store._db.set_progress_handler(None, 1)
    return count


def test_a_jobs_mean_speed_is_read_in_work_that_its_steps_do_not_grow(store: JobStore) -> None:
    # Each status of an ended job (GetJob, each job of a ListJobs page) summed every step it
    # recorded, on the scheduler's event loop: a job of a million steps, a scan of a million
    # rows per read. The totals are the job's own row's now.
    job = store.create("long", "spec", "/data", steps=1_000_000).id
    for step in range(10):
        store.record_step(job, step, 1.0, 16, 0.5)
    few = _work(store, lambda: _speed(store, job))
    # As a long job's steps leave the table, written here at once: one transaction (each row
    # its own, synced, took ten seconds of the suite's)
    with transaction(store._db):
        store._db.executemany(
            "INSERT INTO steps VALUES (?, ?, 1.0, 16, 0.5, 0.0)",
            [(job, step) for step in range(10, 50_000)],
        )
    many = _work(store, lambda: _speed(store, job))
    assert many < few * 2, (few, many)  # an index's depth, not a scan (that is 50,000+)
    assert _speed(store, job) == 32.0


def test_a_store_of_the_schema_before_gains_each_jobs_totals(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    with JobStore(path) as store:
        job = store.create("j", "spec", "/data", 9).id
        store.record_step(job, 0, 2.0, 16, 0.5)
        store.record_step(job, 1, 1.9, 48, 1.5)
    as_before(path, 7)  # as a swarm before the totals left it
    with JobStore(path) as store:
        assert _speed(store, job) == 32.0  # summed once, as the store opens
