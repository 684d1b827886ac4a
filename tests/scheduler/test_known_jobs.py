"""The job API asks the store once per job for the calls trainers make many times a second, and
keeps at most `MAX_KNOWN` job ids for it, the least recently asked forgotten first (before: every
id ever asked for, for the scheduler's life, past the jobs retention deleted)."""

from __future__ import annotations

import pytest

from scheduler.known_jobs import KnownJobs
from swarm.errors import NotFound


def test_a_job_is_looked_up_once_while_kept_and_the_ids_kept_are_bounded() -> None:
    asked: list[str] = []

    def look_up(job_id: str) -> str:
        asked.append(job_id)
        if job_id.startswith("gone"):
            raise NotFound(f"unknown job {job_id!r}")
        return f"submitter of {job_id}"

    known = KnownJobs(look_up, most=3)
    for _ in range(5):
        assert known.check("a") == "submitter of a"  # its submitter, for a lease's audits
    assert asked == ["a"]  # once
    with pytest.raises(NotFound):
        known.check("gone-1")
    with pytest.raises(NotFound):
        known.check("gone-1")  # an unknown one is asked each time: never kept
    for job in ("b", "c", "a", "d"):  # a asked again lately: b goes, the least recent
        known.check(job)
    assert len(known) == 3
    asked.clear()
    known.check("a")
    known.check("b")
    assert asked == ["b"]  # forgotten: asked of the store again
    known.forget("a")  # deleted
    known.check("a")
    assert asked == ["b", "a"]


def test_a_deletion_in_the_store_has_every_job_looked_up_again() -> None:
    """A new job may take a deleted one's id (retention deletes without the job API), and with
    it another submitter: the one kept would tell the old submitter's trainers its audits."""
    submitters, deletions = {"job-1": "alice"}, [0]
    known = KnownJobs(submitters.__getitem__, deletions=lambda: deletions[0])
    assert known.check("job-1") == "alice"
    submitters["job-1"] = "bob"  # deleted, and the id taken by bob's new job
    assert known.check("job-1") == "alice"  # no deletion seen: kept
    deletions[0] += 1
    assert known.check("job-1") == "bob"
