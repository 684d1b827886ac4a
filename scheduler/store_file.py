"""The job store's SQLite file: opened in WAL mode with synchronous=FULL (a committed write
survives a killed process, and power loss), its schema brought up to this swarm's version by
append-only migrations, and one write transaction at a time (`transaction`). One scheduler
process holds a store (`hold`): a second one on the same file is refused, not run beside it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from swarm.errors import ResourceExhausted, SwarmError
from swarm.ops.private import FILE_MODE

__all__ = [
    "SCHEMA_VERSION",
    "StoreError",
    "StoreWriteError",
    "hold",
    "open_store",
    "taken",
    "transaction",
    "write_failed",
]


class StoreError(SwarmError):
    """The store file cannot be used (written by a newer swarm, or not a swarm store), or did
    not take a write (`StoreWriteError`)."""


class StoreWriteError(StoreError, ResourceExhausted):
    """The store's disk did not take a write (full, or failing its I/O; nothing changed). A call
    that needed it is answered RESOURCE_EXHAUSTED, gRPC's code for a full file system, in words,
    not INTERNAL as a bug: the disk is the operator's to free, the call the caller's to make
    again. Any other failed write (a schema that lacks what the code asks, a damaged file,
    another process's lock) stays a plain `StoreError`: a bug, or a store to look at."""


# SQLite's primary result codes of a write its disk refused (`sqlite3.Error.sqlite_errorcode`,
# whose extended codes keep the primary one in their low byte).
_DISK_CODES = frozenset({sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR})


def write_failed(error: sqlite3.Error, said: str) -> StoreError:
    """What a write that raised `error` raises, saying `said`: `StoreWriteError` where the
    store's disk refused it, else `StoreError`."""
    code = getattr(error, "sqlite_errorcode", None)
    if code is not None and code & 0xFF in _DISK_CODES:
        return StoreWriteError(said)
    return StoreError(said)


# Migration i (0-based) takes the schema from version i to i + 1; PRAGMA user_version records
# how many have run. Append, never edit: a deployed store has run the old ones.
_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE jobs (
            id TEXT PRIMARY KEY, name TEXT NOT NULL, spec TEXT NOT NULL, base_dir TEXT NOT NULL,
            state TEXT NOT NULL, step INTEGER NOT NULL, steps INTEGER NOT NULL, loss REAL,
            error TEXT NOT NULL, message TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL
        )""",
        "CREATE INDEX jobs_state ON jobs (state)",
        """CREATE TABLE steps (
            job TEXT NOT NULL REFERENCES jobs (id), step INTEGER NOT NULL, loss REAL,
            samples INTEGER NOT NULL, seconds REAL NOT NULL, time REAL NOT NULL,
            PRIMARY KEY (job, step)
        )""",
    ),
    (  # evaluations: the validation loss of the parameters after `step` updates
        """CREATE TABLE evals (
            job TEXT NOT NULL REFERENCES jobs (id), step INTEGER NOT NULL, val_loss REAL,
            time REAL NOT NULL, PRIMARY KEY (job, step)
        )""",
    ),
    (  # the job's history for operators: joins, leaves and why, stalls, rollbacks, its end
        """CREATE TABLE events (
            job TEXT NOT NULL REFERENCES jobs (id), time REAL NOT NULL, kind TEXT NOT NULL,
            text TEXT NOT NULL
        )""",
        "CREATE INDEX events_job ON events (job, time)",
    ),
    (  # who submitted each job ("": the swarm token alone, and every job stored before this)
        "ALTER TABLE jobs ADD COLUMN submitter TEXT NOT NULL DEFAULT ''",
        "CREATE INDEX jobs_submitter ON jobs (submitter, state)",
    ),
    (  # the peers banned from each job (`scheduler.store_bans`): a restarted scheduler keeps them
        """CREATE TABLE bans (
            job TEXT NOT NULL REFERENCES jobs (id), peer TEXT NOT NULL, stage INTEGER NOT NULL,
            step INTEGER NOT NULL, since INTEGER NOT NULL, reason TEXT NOT NULL,
            replayed INTEGER NOT NULL, time REAL NOT NULL, PRIMARY KEY (job, peer)
        )""",
    ),
    (  # the first step each peer was a member of a job at (`scheduler.store_bans`): a ban's depth
        """CREATE TABLE members (
            job TEXT NOT NULL REFERENCES jobs (id), peer TEXT NOT NULL, since INTEGER NOT NULL,
            PRIMARY KEY (job, peer)
        )""",
    ),
    (  # which job each submission made, by its request id (`scheduler.store_requests`)
        """CREATE TABLE requests (
            submitter TEXT NOT NULL, request TEXT NOT NULL,
            job TEXT NOT NULL REFERENCES jobs (id), PRIMARY KEY (submitter, request)
        )""",
        "CREATE INDEX requests_job ON requests (job)",
    ),
    (  # each job's samples and seconds over its recorded steps: its mean speed, in its own row
        "ALTER TABLE jobs ADD COLUMN samples_done INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN seconds_done REAL NOT NULL DEFAULT 0",
        """UPDATE jobs SET
            samples_done = COALESCE((SELECT SUM(samples) FROM steps WHERE steps.job = jobs.id), 0),
            seconds_done = COALESCE((SELECT SUM(seconds) FROM steps WHERE steps.job = jobs.id), 0)
        """,
    ),
)
SCHEMA_VERSION = len(_MIGRATIONS)


def open_store(path: Path) -> sqlite3.Connection:
    """A connection to the store at `path` (created when missing), its schema migrated to
    `SCHEMA_VERSION`; StoreError for a file that is not a usable store."""
    try:
        # Created 0600 before SQLite opens it: its -wal and -shm files take the store's mode,
        # and it holds every job's spec and history (SQLite alone would create it 0644).
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE))
        # isolation_level=None: autocommit; multi-statement writes use `transaction`.
        db = sqlite3.connect(path, isolation_level=None)
    except (OSError, sqlite3.Error) as e:
        raise StoreError(f"cannot open the job store {str(path)!r} ({e})") from None
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")  # a commit survives power loss too
        db.execute("PRAGMA foreign_keys=ON")
        _migrate(db, path)
    except BaseException as e:
        db.close()
        if isinstance(e, sqlite3.Error):
            raise StoreError(f"{str(path)!r} is not a usable job store ({e})") from None
        raise
    return db


def _migrate(db: sqlite3.Connection, path: Path) -> None:
    with transaction(db):  # read and bump the version under one write lock: two schedulers
        version = int(db.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{str(path)!r} has schema version {version}, newer than this swarm's "
                f"{SCHEMA_VERSION}; upgrade swarm or use another store file"
            )
        for i in range(version, SCHEMA_VERSION):
            for statement in _MIGRATIONS[i]:
                db.execute(statement)
            db.execute(f"PRAGMA user_version = {i + 1}")  # transactional in SQLite


@contextlib.contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[None]:
    """One write transaction, committed on exit (the connection is in autocommit mode)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        # A failed COMMIT (disk full) leaves the transaction open: end it, or every later
        # write fails with "cannot start a transaction within a transaction".
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


@contextlib.contextmanager
def taken(path: Path) -> Iterator[None]:
    """A write the store's file at `path` must take: StoreError where it cannot (a full disk:
    nothing changed), which the callers that wait a full disk out catch, where sqlite3's own
    error ended them. A constraint the write breaks stays sqlite3.IntegrityError: the caller's
    to tell (a job id taken)."""
    try:
        yield
    except sqlite3.IntegrityError:
        raise
    except sqlite3.Error as e:
        raise write_failed(e, f"the job store {str(path)!r} did not take a write: {e}") from e


@contextlib.contextmanager
def hold(path: Path) -> Iterator[None]:
    """Hold the store at `path` for this process, or raise StoreError naming the process that
    does: a lock on `<store>.lock` beside it (released by the system when the process ends,
    however it ends), which records the holder's pid. Two schedulers on one store would each
    lease the same jobs' work and overwrite each other's records."""
    lock = path.with_name(path.name + ".lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, FILE_MODE)
    except OSError as e:
        raise StoreError(f"cannot lock the job store {str(path)!r}: {lock}: {e.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            by = f" (pid {holder})" if holder.isdigit() else ""
            raise StoreError(
                f"the job store {path} is in use by another scheduler{by}: stop it, or give "
                "this one another store (--store PATH, SWARM_STORE)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
