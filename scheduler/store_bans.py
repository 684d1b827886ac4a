"""A job's bans in the job store (issue 55): each peer an audit or its round's sum checks
convicted, kept so that a restarted scheduler's coordinator starts with it banned
(`scheduler.coordinator.bans`), and whether the rollback that took its work away has run.

Bounded: a job keeps at most `MAX_BANS` (a ban costs the job a rollback, so an honest job has
few; past that, a ban holds only as long as its coordinator and is said in the log), each reason
cut to `MAX_BAN_REASON` characters, and an id longer than `MAX_BANNED_ID` is not kept (no
honest peer's id is that long)."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from scheduler.store_file import StoreError, transaction

__all__ = [
    "MAX_BANNED_ID",
    "MAX_BANS",
    "MAX_BAN_REASON",
    "BanRow",
    "bans_of",
    "insert_ban",
    "replayed",
]

MAX_BANS = 100
MAX_BAN_REASON = 500
MAX_BANNED_ID = 1024


@dataclass(frozen=True)
class BanRow:
    peer: str
    stage: int
    step: int  #: the step it was caught at
    since: int  #: the first step its work may be in: the rollback went to a checkpoint at or before
    reason: str  #: the evidence, for people
    replayed: bool = False  #: that rollback has run: no state of the job holds its work
    time: float = 0.0  #: unix seconds of the ban


def insert_ban(db: sqlite3.Connection, job_id: str, ban: BanRow, now: float) -> bool:
    """Keep `ban` of `job_id`; False when it is not (the peer is kept already, its id is too
    long, or the job keeps `MAX_BANS`). StoreError when the write fails."""
    if len(ban.peer) > MAX_BANNED_ID:
        return False
    try:
        with transaction(db):
            held = db.execute("SELECT COUNT(*) FROM bans WHERE job = ?", (job_id,)).fetchone()[0]
            if held >= MAX_BANS:
                return False
            return bool(
                db.execute(
                    "INSERT OR IGNORE INTO bans VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        job_id,
                        ban.peer,
                        ban.stage,
                        ban.step,
                        ban.since,
                        ban.reason[:MAX_BAN_REASON],
                        int(ban.replayed),
                        now,
                    ),
                ).rowcount
            )
    except sqlite3.Error as e:
        raise StoreError(f"the ban of {ban.peer} in job {job_id!r} not recorded ({e})") from e


def bans_of(db: sqlite3.Connection, job_id: str) -> list[BanRow]:
    """`job_id`'s bans, the oldest first."""
    rows = db.execute(
        "SELECT peer, stage, step, since, reason, replayed, time FROM bans WHERE job = ?"
        " ORDER BY time, rowid",
        (job_id,),
    )
    return [BanRow(r[0], r[1], r[2], r[3], r[4], bool(r[5]), r[6]) for r in rows]


def replayed(db: sqlite3.Connection, job_id: str, step: int) -> None:
    """`job_id`'s state is the one after `step` steps again (a rollback, or a resumed job whose
    replicas hold that step): every ban whose work starts at `step` or later has none in it.
    Within the caller's transaction."""
    db.execute("UPDATE bans SET replayed = 1 WHERE job = ? AND since >= ?", (job_id, step))
