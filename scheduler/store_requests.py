"""Which job each submission made, by its request id (`SchedulerSubmitJobRequest.request_id`):
a submission asked again after its answer was lost finds the job it made, where it would make a
second one (`scheduler.job_api`). Kept per submitter (one's ids are not another's) as long as the
job is; a submission without an id keeps nothing."""

from __future__ import annotations

import sqlite3

__all__ = ["job_of", "remember"]


def remember(db: sqlite3.Connection, submitter: str, request: str, job: str) -> None:
    """`job` is what `submitter`'s request `request` made (inside the transaction that made it)."""
    if request:
        db.execute(
            "INSERT INTO requests (submitter, request, job) VALUES (?, ?, ?)",
            (submitter, request, job),
        )


def job_of(db: sqlite3.Connection, submitter: str, request: str) -> str | None:
    """The job `submitter`'s request `request` made, if it made one that is still kept."""
    if not request:
        return None
    row = db.execute(
        "SELECT job FROM requests WHERE submitter = ? AND request = ?", (submitter, request)
    ).fetchone()
    return None if row is None else str(row[0])
