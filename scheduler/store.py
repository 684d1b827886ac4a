"""The scheduler's durable job store: SQLite, one connection, used from one thread; the queries
of jobs, their steps, evaluations, events, bans and members (`scheduler.store_bans`; the file,
its schema and transactions: `scheduler.store_file`).

Every write is its own committed transaction (WAL, synchronous=FULL), so what a call reported as
stored survives a killed process; one the file cannot take (a full disk) raises `StoreWriteError`.
A step record so refused is kept in memory: the job's next step record writes it first, so a
passing write problem loses no committed step (a scheduler that dies meanwhile loses the kept
rows; the replicas still hold the steps' state). Methods are synchronous and fast (one small
transaction); call them from the event loop's thread, between awaits, so a read-then-write is
never interleaved. The job state machine lives here, so no caller can move a finished job again.
"""

from __future__ import annotations

import math
import secrets
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Self, cast

from scheduler.store_bans import MAX_BANS, BanRow, bans_of, insert_ban, replayed, see, seen_of
from scheduler.store_file import (
    SCHEMA_VERSION,
    StoreError,
    StoreWriteError,
    open_store,
    taken,
    transaction,
    write_failed,
)
from scheduler.store_pages import page_of, position
from scheduler.store_requests import job_of, remember
from scheduler.store_rows import EventRow, JobRecord, StepRow  # re-exported
from swarm.errors import FailedPrecondition, InvalidArgument, NotFound
from swarm.job.states import (  # re-exported
    JOB_STATES,
    TERMINAL,
    UNFINISHED,
    JobState,
    may_move,
)

__all__ = [
    "MAX_BANS",
    "SCHEMA_VERSION",
    "TERMINAL",
    "UNFINISHED",
    "BanRow",
    "EventRow",
    "JobRecord",
    "JobState",
    "JobStore",
    "StepRow",
    "StoreError",
    "StoreWriteError",
]

# A job record's columns: the row, the loss of its step 0 (what `swarm demo` starts from), and
# its newest evaluation.
_LAST_EVAL = "FROM evals WHERE evals.job = jobs.id ORDER BY evals.step DESC LIMIT 1"
_COLUMNS = (
    "*, (SELECT loss FROM steps WHERE steps.job = jobs.id AND steps.step = 0) AS first_loss, "
    f"(SELECT val_loss {_LAST_EVAL}) AS val_loss, (SELECT step {_LAST_EVAL}) AS val_step"
)
# A listing's columns: the record without its spec (up to MAX_SPEC_BYTES each, more if stored by
# an older scheduler), and the row's position for the next page's cursor.
_LISTED = _COLUMNS.replace(
    "*",
    "id, name, '' AS spec, base_dir, state, step, steps, loss, error, message, created, updated,"
    " submitter, samples_done, seconds_done",
    1,
)

# Events kept per job: the newest; a job of days with a flapping peer must not grow the store
# without bound (`swarm status` shows the newest few anyway).
MAX_EVENTS = 1000
# An event's text is cut to this (it may quote a peer's own words: an error, its id).
MAX_EVENT_TEXT = 500


# Aliases: inside JobStore, `list` names its method, not the builtin.
Records = list[JobRecord]
Ids = list[str]
Steps = list[StepRow]
Evals = list[tuple[int, float]]
Events = list[EventRow]
BanRows = list[BanRow]


def _loss(value: float | None) -> float:
    return math.nan if value is None else float(value)  # SQLite stores NaN as NULL


class JobStore:
    def __init__(self, path: str | Path, *, clock: Callable[[], float] = time.time) -> None:
        self.path, self._clock = Path(path), clock
        # job -> step -> (loss, samples, seconds, time): step records whose write failed
        self._kept: dict[str, dict[int, tuple[float, int, float, float]]] = {}
        self._db = open_store(self.path)
        self._db.row_factory = sqlite3.Row
        # jobs deleted through this store (by retention too): what a cache of jobs by id
        # (`scheduler.known_jobs`) drops itself at, since a new job may take a deleted one's id
        self.deletions = 0

    def _write(self, sql: str, args: tuple[Any, ...]) -> int:
        """Run one statement as its own committed transaction; returns the rows it changed."""
        with taken(self.path):  # autocommit: one statement, one commit
            return self._db.execute(sql, args).rowcount

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- jobs -----------------------------------------------------------------------------------
    def create(
        self,
        name: str,
        spec: str,
        base_dir: str,
        steps: int,
        submitter: str = "",
        request: str = "",
    ) -> JobRecord:
        """Store a new queued job of `submitter`, made by its `request` ("": none;
        `by_request`); its id is `{name}-{6 random hex digits}`."""
        now = self._clock()
        for _ in range(8):  # 16M ids per name: a collision is rare, and retried
            job_id = f"{name}-{secrets.token_hex(3)}"
            try:
                with taken(self.path), transaction(self._db):  # the job and its request, or none
                    self._db.execute(
                        "INSERT INTO jobs (id, name, spec, base_dir, state, step, steps, loss,"
                        " error, message, created, updated, submitter)"
                        " VALUES (?, ?, ?, ?, 'queued', 0, ?, NULL, '', '', ?, ?, ?)",
                        (job_id, name, spec, base_dir, steps, now, now, submitter),
                    )
                    remember(self._db, submitter, request, job_id)
            except sqlite3.IntegrityError:
                continue
            return self._require(job_id)
        raise StoreError(f"could not find a free job id for {name!r}")

    def by_request(self, submitter: str, request: str) -> JobRecord | None:
        """The job `submitter`'s submission `request` made, while it is kept."""
        job_id = job_of(self._db, submitter, request)
        return None if job_id is None else self.get(job_id)

    def get(self, job_id: str) -> JobRecord | None:
        row = self._db.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else self._record(row)

    def list(self) -> Records:
        """Every job, newest first."""
        rows = self._db.execute(f"SELECT {_COLUMNS} FROM jobs ORDER BY created DESC, rowid DESC")
        return [self._record(r) for r in rows]

    def page(
        self, limit: int, cursor: str = "", *, budget: int | None = None
    ) -> tuple[Records, str]:
        """Up to `limit` jobs newest first, without their specs, after `cursor` ("": from the
        newest); and the cursor of the next page ("" when none is left). A cursor names a position
        (created, rowid), not an offset: jobs created or deleted meanwhile shift nothing. With a
        `budget`, the page also ends after the job that takes its text (id, name, base_dir, error,
        message) to `budget` bytes or more: it holds one job at least, and rows past the end are
        never read."""
        limit = max(limit, 1)
        created, row = position(cursor) if cursor else (math.inf, 0)
        rows = self._db.execute(
            f"SELECT {_LISTED}, rowid AS position FROM jobs WHERE created < ? OR"
            " (created = ? AND rowid < ?) ORDER BY created DESC, rowid DESC LIMIT ?",
            (created, created, row, limit + 1),  # one more: is there a next page?
        )
        return page_of(rows, limit, budget, self._record)

    def unfinished(self) -> Records:
        """Unfinished jobs (queued, placing, running, stalled), oldest first: what a restarted
        scheduler resumes."""
        marks = ", ".join("?" * len(UNFINISHED))
        rows = self._db.execute(
            f"SELECT {_COLUMNS} FROM jobs WHERE state IN ({marks}) ORDER BY created, rowid",
            UNFINISHED,
        )
        return [self._record(r) for r in rows]

    def set_state(
        self, job_id: str, state: JobState, *, error: str | None = None, message: str | None = None
    ) -> JobRecord:
        """Move a job to `state`; `error`/`message` replace the stored ones when given.

        Raises FailedPrecondition for a move the state machine forbids (a finished job is final).
        """
        if state not in JOB_STATES:
            raise InvalidArgument(f"unknown job state {state!r}; allowed: {JOB_STATES}")
        old = self._require(job_id)
        if not may_move(old.state, state):
            raise FailedPrecondition(f"job {job_id!r} is {old.state}; it cannot become {state}")
        self._write(
            "UPDATE jobs SET state = ?, error = COALESCE(?, error), message = COALESCE(?, message),"
            " updated = ? WHERE id = ?",
            (state, error, message, self._clock(), job_id),
        )
        return self._require(job_id)

    def delete(self, job_id: str) -> None:
        """Forget a finished job: its record, steps and evaluations. An unfinished one is refused
        (FailedPrecondition): it is still being trained."""
        job = self._require(job_id)
        if not job.finished:
            raise FailedPrecondition(f"job {job_id!r} is {job.state}; cancel it first")
        with taken(self.path), transaction(self._db):  # all of it or none
            for table in ("requests", "members", "bans", "events", "evals", "steps"):
                self._db.execute(f"DELETE FROM {table} WHERE job = ?", (job_id,))
            self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
        self._kept.pop(job_id, None)
        self.deletions += 1

    def ended_last(self, limit: int) -> Ids:
        """The `limit` finished jobs that ended most recently (by their last update), newest
        first."""
        marks = ", ".join("?" * len(TERMINAL))
        rows = self._db.execute(
            f"SELECT id FROM jobs WHERE state IN ({marks}) ORDER BY updated DESC, rowid DESC"
            " LIMIT ?",
            (*TERMINAL, limit),
        )
        return [r["id"] for r in rows]

    def finished_beyond(self, keep: int) -> Ids:
        """Each submitter's finished jobs but the `keep` of theirs that ended most recently (by
        their last update), most recent first: what a retention of `keep` finished jobs per
        submitter deletes. Per submitter: one who ends many jobs deletes only their own."""
        marks = ", ".join("?" * len(TERMINAL))
        rows = self._db.execute(
            "SELECT id FROM (SELECT id, updated, rowid AS r, ROW_NUMBER() OVER (PARTITION BY"
            " submitter ORDER BY updated DESC, rowid DESC) AS rank FROM jobs WHERE state IN"
            f" ({marks})) WHERE rank > ? ORDER BY updated DESC, r DESC",
            (*TERMINAL, keep),
        )
        return [r["id"] for r in rows]

    def unfinished_of(self, submitter: str) -> int:
        """How many of `submitter`'s jobs are unfinished (queued, placing, running, stalled)."""
        marks = ", ".join("?" * len(UNFINISHED))
        sql = f"SELECT COUNT(*) FROM jobs WHERE submitter = ? AND state IN ({marks})"
        return int(self._db.execute(sql, (submitter, *UNFINISHED)).fetchone()[0])

    def set_message(self, job_id: str, message: str) -> None:
        changed = self._write(
            "UPDATE jobs SET message = ?, updated = ? WHERE id = ?",
            (message, self._clock(), job_id),
        )
        if not changed:
            raise NotFound(f"unknown job {job_id!r}")

    # -- steps ----------------------------------------------------------------------------------
    def record_step(
        self, job_id: str, step: int, loss: float, samples: int, seconds: float
    ) -> bool:
        """Record committed step `step`; the job's step becomes `step + 1` and its loss `loss`.

        Idempotent: a step already recorded changes nothing (returns False), so a retried report
        after a scheduler restart cannot count a step twice.
        """
        job = self._require(job_id)
        if not 0 <= step < job.steps:
            raise InvalidArgument(f"step {step} of job {job_id!r} is outside 0..{job.steps - 1}")
        kept = self._kept.setdefault(job_id, {})
        row = (loss, samples, seconds, self._clock())
        rows = [*sorted(kept.items()), (step, row)]  # earlier failed records first, in order
        try:
            with transaction(self._db):  # every row and the job's step, or nothing
                inserted = [self._insert_step(job_id, s, *r) for s, r in rows]
        except sqlite3.Error as e:
            kept.setdefault(step, row)  # a retried report keeps the first, as the table does
            raise write_failed(
                e,
                f"step {step} of job {job_id!r} not recorded in {str(self.path)!r} ({e}); "
                f"kept, and written with the next step ({len(kept)} waiting)",
            ) from e
        self._kept.pop(job_id, None)
        return inserted[-1]

    def _insert_step(
        self, job_id: str, step: int, loss: float, samples: int, seconds: float, now: float
    ) -> bool:
        inserted = self._db.execute(
            "INSERT OR IGNORE INTO steps VALUES (?, ?, ?, ?, ?, ?)",
            (job_id, step, loss, samples, seconds, now),
        ).rowcount
        if inserted:
            # Right-hand sides see the old row: the loss follows the newest step only.
            self._db.execute(
                "UPDATE jobs SET loss = CASE WHEN ? >= step THEN ? ELSE loss END,"
                " step = MAX(step, ?), updated = ?, samples_done = samples_done + ?,"
                " seconds_done = seconds_done + ? WHERE id = ?",
                (step + 1, loss, step + 1, now, samples, seconds, job_id),
            )
        return bool(inserted)

    def record_eval(self, job_id: str, step: int, val_loss: float) -> None:
        """Record the validation loss of the parameters after `step` updates (idempotent, as
        `record_step`: a retried record keeps the first)."""
        job = self._require(job_id)
        if not 0 <= step <= job.steps:
            raise InvalidArgument(
                f"evaluation at step {step} of job {job_id!r}: outside 0..{job.steps}"
            )
        try:
            with transaction(self._db):
                self._db.execute(
                    "INSERT OR IGNORE INTO evals VALUES (?, ?, ?, ?)",
                    (job_id, step, val_loss, self._clock()),
                )
        except sqlite3.Error as e:
            raise write_failed(
                e,
                f"evaluation at step {step} of job {job_id!r} not recorded in "
                f"{str(self.path)!r} ({e})",
            ) from e

    # -- events -------------------------------------------------------------------------------
    def record_event(self, job_id: str, kind: str, text: str) -> None:
        """Add to the job's history (keeping its newest `MAX_EVENTS`). A write that fails (a
        full disk) raises `StoreError`: the history is for people, training goes on."""
        try:
            with transaction(self._db):
                self._db.execute(
                    "INSERT INTO events VALUES (?, ?, ?, ?)",
                    (job_id, self._clock(), kind, text[:MAX_EVENT_TEXT]),
                )
                self._db.execute(
                    "DELETE FROM events WHERE job = ? AND rowid <= (SELECT rowid FROM events"
                    " WHERE job = ? ORDER BY rowid DESC LIMIT 1 OFFSET ?)",
                    (job_id, job_id, MAX_EVENTS),
                )
        except sqlite3.Error as e:
            raise write_failed(e, f"event of job {job_id!r} not recorded ({e}): {text}") from e

    def events(self, job_id: str, newest: int = MAX_EVENTS) -> Events:
        """The job's newest `newest` events, oldest first."""
        rows = self._db.execute(
            "SELECT time, kind, text FROM (SELECT rowid, * FROM events WHERE job = ?"
            " ORDER BY rowid DESC LIMIT ?) ORDER BY rowid",
            (job_id, newest),
        )
        return [EventRow(r["time"], r["kind"], r["text"]) for r in rows]

    def evals(self, job_id: str) -> Evals:
        """The job's evaluations in order: (step, validation loss)."""
        rows = self._db.execute(
            "SELECT step, val_loss FROM evals WHERE job = ? ORDER BY step", (job_id,)
        )
        return [(r["step"], _loss(r["val_loss"])) for r in rows]

    def rewind(self, job_id: str, step: int) -> None:
        """Forget steps `step..` (a rollback to the checkpoint after step `step - 1`)."""
        self._require(job_id)
        kept = self._kept.get(job_id, {})
        for later in [s for s in kept if s >= step]:  # those steps are trained again
            del kept[later]
        with taken(self.path), transaction(self._db):
            self._db.execute("DELETE FROM steps WHERE job = ? AND step >= ?", (job_id, step))
            replayed(self._db, job_id, step)  # the bans whose work starts here have none in it
            # The parameters after `step` updates are the checkpoint's: their evaluation holds.
            self._db.execute("DELETE FROM evals WHERE job = ? AND step > ?", (job_id, step))
            # The totals over the steps left: a rollback is rare, a status read is not.
            self._db.execute(
                "UPDATE jobs SET step = ?, updated = ?, loss = (SELECT loss FROM steps"
                " WHERE job = ? AND step = ?), samples_done = (SELECT COALESCE(SUM(samples), 0)"
                " FROM steps WHERE job = ?), seconds_done = (SELECT COALESCE(SUM(seconds), 0)"
                " FROM steps WHERE job = ?) WHERE id = ?",
                (step, self._clock(), job_id, step - 1, job_id, job_id, job_id),
            )

    def trained(self, job_id: str) -> int:
        """The step the job has trained to as this store knows it: its recorded step, or past
        it the step after a record whose write failed and is held (a full disk)."""
        kept = self._kept.get(job_id)
        return max(self._require(job_id).step, max(kept) + 1 if kept else 0)

    def resume(self, job_id: str, step: int) -> None:
        """The job's coordinator (re)starts at `step`. Steps recorded from `step` on belong to a
        run that was lost (every replica restarted empty, say) and are trained again: forget
        them, so the store shows the re-run and not the old rows (`record_step` keeps the first
        record of a step). A store behind `step` (killed between a commit and its record) is
        left as it is."""
        if step < self._require(job_id).step:
            self.rewind(job_id, step)

    def steps(self, job_id: str) -> Steps:
        """The job's recorded steps in order."""
        rows = self._db.execute("SELECT * FROM steps WHERE job = ? ORDER BY step", (job_id,))
        return [
            StepRow(r["job"], r["step"], _loss(r["loss"]), r["samples"], r["seconds"], r["time"])
            for r in rows
        ]

    # -- bans -----------------------------------------------------------------------------------
    def record_ban(self, job_id: str, ban: BanRow) -> bool:
        """Keep `ban` of the job (`scheduler.store_bans`); False when it is not (kept already,
        or the job keeps `MAX_BANS`). StoreError when the write fails (a full disk)."""
        self._require(job_id)
        return insert_ban(self._db, job_id, ban, self._clock())

    def bans(self, job_id: str) -> BanRows:
        """The job's bans, the oldest first: those its next coordinator starts with."""
        return bans_of(self._db, job_id)

    def record_seen(self, job_id: str, peer: str, step: int) -> bool:
        """Keep when `peer` was first a member of the job (`scheduler.store_bans.see`)."""
        return see(self._db, job_id, peer, step)

    def seen(self, job_id: str) -> dict[str, int]:
        """Each peer kept by `record_seen`, with the first step it was a member at."""
        return seen_of(self._db, job_id)

    # -- helpers --------------------------------------------------------------------------------
    def _require(self, job_id: str) -> JobRecord:
        job = self.get(job_id)
        if job is None:
            raise NotFound(f"unknown job {job_id!r}")
        return job

    @staticmethod
    def _record(row: sqlite3.Row) -> JobRecord:
        d = dict(row)
        d.pop("position", None)  # a listing's cursor, not the record's
        d["loss"], d["state"] = _loss(d["loss"]), cast(JobState, d["state"])
        d["first_loss"], d["val_loss"] = _loss(d["first_loss"]), _loss(d["val_loss"])
        d["val_step"] = -1 if d["val_step"] is None else d["val_step"]
        return JobRecord(**d)
