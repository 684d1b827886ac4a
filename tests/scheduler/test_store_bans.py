"""A job's bans in the job store (`scheduler.store_bans`): kept once per peer and bounded (a
job's count, a reason's length, an id's), marked replayed once the job's state is back at or
before the ban's first step, deleted with the job, and added to a store of the schema before."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import scheduler.store_bans as store_bans
from scheduler.store import BanRow, JobStore, StoreError, StoreWriteError
from scheduler.store_bans import MAX_BANNED_ID
from tests.support.store_schema import as_before


@pytest.fixture
def store(tmp_path: Path) -> Iterator[JobStore]:
    with JobStore(tmp_path / "jobs.db") as s:
        yield s


def test_a_ban_is_kept_once_per_peer_and_bounded(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_bans, "MAX_BANS", 3)
    job, other = (store.create(name, "spec", "/data", 9).id for name in ("j", "k"))
    assert store.record_ban(job, BanRow("liar", 1, 5, 2, "x" * 10_000))
    assert not store.record_ban(job, BanRow("liar", 0, 6, 6, "again"))  # the first holds
    assert not store.record_ban(job, BanRow("y" * 2000, 0, 6, 6, "a made-up id"))
    assert store.record_ban(job, BanRow("b", 0, 6, 6, "b lied"))
    assert store.record_ban(job, BanRow("c", 0, 7, 6, "c lied"))
    assert not store.record_ban(job, BanRow("d", 0, 8, 6, "d lied"))  # the job keeps 3
    assert store.record_ban(other, BanRow("d", 0, 8, 6, "d lied"))  # per job
    kept = store.bans(job)
    assert [(b.peer, b.stage, b.step, b.since, b.replayed) for b in kept] == [
        ("liar", 1, 5, 2, False),
        ("b", 0, 6, 6, False),
        ("c", 0, 7, 6, False),
    ]
    assert len(kept[0].reason) == store_bans.MAX_BAN_REASON and kept[0].time > 0
    assert [b.peer for b in store.bans(other)] == ["d"]


def test_a_ban_is_replayed_once_the_job_is_back_at_or_before_its_first_step(
    store: JobStore,
) -> None:
    job = store.create("j", "spec", "/data", 9).id
    for step in range(6):
        store.record_step(job, step, 1.0, 4, 0.1)
    store.record_ban(job, BanRow("early", 0, 5, 1, "its outputs differ"))
    store.record_ban(job, BanRow("late", 1, 5, 4, "its outputs differ"))
    store.resume(job, 6)  # the replicas hold every recorded step: nothing taken back
    assert [b.replayed for b in store.bans(job)] == [False, False]
    store.rewind(job, 2)  # a checkpoint after "early"'s first step: its work may be in it
    assert [b.replayed for b in store.bans(job)] == [False, True]
    store.rewind(job, 0)
    assert [b.replayed for b in store.bans(job)] == [True, True]


def test_bans_are_deleted_with_their_job(store: JobStore) -> None:
    job, other = (store.create(name, "spec", "/data", 9).id for name in ("j", "k"))
    for j in (job, other):
        store.record_ban(j, BanRow("liar", 0, 1, 0, "its outputs differ"))
    store.set_state(job, "cancelled")
    store.delete(job)
    assert store.bans(job) == [] and len(store.bans(other)) == 1


def test_a_store_of_the_schema_before_gains_the_bans(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    with JobStore(path) as store:
        job = store.create("j", "spec", "/data", 9).id
    as_before(path, 4)  # as a swarm before kept bans left it
    with JobStore(path) as store:
        assert store.bans(job) == []
        assert store.record_ban(job, BanRow("liar", 0, 1, 0, "its outputs differ"))


def test_a_ban_that_cannot_be_written_raises_store_error(tmp_path: Path) -> None:
    with JobStore(tmp_path / "jobs.db") as store:
        job = store.create("j", "spec", "/data", 9).id
        store._db.execute("DROP TABLE bans")  # a write that fails, as on a broken file
        with pytest.raises(StoreError, match="the ban of liar") as e:
            store.record_ban(job, BanRow("liar", 0, 1, 0, "its outputs differ"))
        assert not isinstance(e.value, StoreWriteError)  # no disk's doing: a bug's, said so


def test_when_members_came_is_kept_bounded_and_deleted_with_its_job(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 64: the first step each peer was a member at (a ban's rollback goes no deeper)."""
    job, other = (store.create(name, "spec", "/data", 9).id for name in ("j", "k"))
    assert store.record_seen(job, "a", 5) and store.record_seen(job, "a", 7)
    assert store.record_seen(job, "b", 3) and store.record_seen(job, "a", 2)
    assert store.seen(job) == {"a": 2, "b": 3}  # the earliest step kept
    assert not store.record_seen(job, "x" * (MAX_BANNED_ID + 1), 1)
    monkeypatch.setattr(store_bans, "MAX_MEMBERS", 2)
    assert not store.record_seen(job, "c", 4) and store.record_seen(job, "b", 1)
    store.record_seen(other, "a", 0)
    store.set_state(job, "cancelled")
    store.delete(job)
    assert store.seen(job) == {} and store.seen(other) == {"a": 0}
