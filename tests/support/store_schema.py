"""A job store as an older swarm left it: the tables and columns each later migration added,
taken out again, and its schema version set back (`scheduler.store_file`'s migrations)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

__all__ = ["as_before"]

# What undoes migration i (0-based: it took the schema from version i to i + 1), for those a
# test goes back over.
_UNDO: dict[int, tuple[str, ...]] = {
    1: ("DROP TABLE evals",),
    2: ("DROP TABLE events",),
    3: ("DROP INDEX jobs_submitter", "ALTER TABLE jobs DROP COLUMN submitter"),
    4: ("DROP TABLE bans",),
    5: ("DROP TABLE members",),
    6: ("DROP TABLE requests",),
    7: (
        "ALTER TABLE jobs DROP COLUMN samples_done",
        "ALTER TABLE jobs DROP COLUMN seconds_done",
    ),
}


def as_before(path: Path, version: int) -> None:
    """The store at `path` (closed) as it was at schema `version`: what every migration from
    `version` on added, dropped, newest first, and its data otherwise kept."""
    db = sqlite3.connect(path)
    try:
        newest = db.execute("PRAGMA user_version").fetchone()[0]
        for migration in range(newest - 1, version - 1, -1):
            for statement in _UNDO[migration]:
                db.execute(statement)
        db.execute(f"PRAGMA user_version = {version}")
        db.commit()
    finally:
        db.close()
