"""A job's ban book on a full disk (`scheduler.stored_bans`): a ban the store cannot write is
held and written once there is room, and the next attempt at the job starts with it. Before,
the ban held for the coordinator that made it only: every attempt builds a coordinator from the
store, and the banned peer was a member again from the next one (any lost stage ends one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.coordinator.trust.standing import Ban
from scheduler.service import Scheduler, SchedulerOptions
from scheduler.store import JobStore
from scheduler.stored_bans import StoredBans
from tests.support.disks import fill, tiny_disk
from tests.support.fakes import SilentBus

BAN = Ban("liar", 1, 7, 5, "its outputs differ from two replicas' re-execution")


def test_a_ban_the_full_store_refused_holds_and_is_written_once_there_is_room(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with tiny_disk(tmp_path / "disk") as disk:
        with JobStore(disk / "jobs.db") as store:
            job = store.create("j", "", "/", 9).id
            book = StoredBans(store, job)
            filler = fill(disk)
            book.keep(BAN)
            book.see("late", 4)
            # the next attempt (this scheduler's, the same book) starts with them
            assert book.kept() == [BAN] and book.seen() == {"late": 4}
            assert book.waiting
            assert "held by this scheduler and written once the store has room" in caplog.text
            assert StoredBans(store, job).kept() == []  # not in the store yet
            filler.unlink()
            assert book.kept() == [BAN] and not book.waiting  # written as it was read
        with JobStore(disk / "jobs.db") as store:  # and durable
            again = StoredBans(store, job)
            assert [(b.peer, b.since, b.evidence) for b in again.kept()] == [
                (BAN.peer, BAN.since, BAN.evidence)
            ]
            assert again.seen() == {"late": 4}


def test_each_attempt_at_a_job_takes_the_book_whose_write_waits(tmp_path: Path) -> None:
    with tiny_disk(tmp_path / "disk") as disk, JobStore(disk / "jobs.db") as store:
        job = store.create("j", "", "/", 9).id
        scheduler = Scheduler(store, SilentBus(), SchedulerOptions(tmp_path / "ckpt"))  # type: ignore[arg-type]
        training = scheduler._training
        first = training._ban_book(job)
        assert training._ban_book(job) is not first  # nothing waits: the store has it all
        first = training._ban_book(job)
        filler = fill(disk)
        first.keep(BAN)
        assert training._ban_book(job) is first  # the next attempt's
        filler.unlink()
        assert first.kept() == [BAN] and not first.waiting
        assert training._ban_book(job) is not first
