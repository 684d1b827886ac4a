"""A job's bans in the job store (issue 55): each peer an audit or its round's sum checks
convicted, kept so that a restarted scheduler's coordinator starts with it banned
(`scheduler.coordinator.trust.bans`), and whether the rollback that took its work away has run.

Bounded: a job keeps at most `MAX_BANS` (a ban costs the job a rollback, so an honest job has
few; past that, a ban holds only as long as its coordinator and is said in the log), each reason
cut to `MAX_BAN_REASON` characters, and an id longer than `MAX_BANNED_ID` is not kept (no
honest peer's id is that long).

Beside them, when each peer was first a member of the job (`see`, `seen_of`): the step a ban of
it rolls back to at most, which a restarted scheduler would otherwise take as 0 for every peer
present at its start (issue 64). Bounded the same way: `MAX_MEMBERS` a job (new members enter a
pool at a bounded rate: `scheduler.coordinator.entry`), ids of up to `MAX_BANNED_ID`
characters; a peer not kept is taken as present from step 0 after a restart, as before, its
rollback still no deeper than its doubt window."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from scheduler.store_file import transaction, write_failed

__all__ = [
    "MAX_BANNED_ID",
    "MAX_BANS",
    "MAX_BAN_REASON",
    "MAX_MEMBERS",
    "BanRow",
    "bans_of",
    "insert_ban",
    "replayed",
    "see",
    "seen_of",
]

MAX_BANS = 100
MAX_BAN_REASON = 500
MAX_BANNED_ID = 1024
MAX_MEMBERS = 4096


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
        raise write_failed(e, f"the ban of {ban.peer} in job {job_id!r} not recorded ({e})") from e


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


def see(db: sqlite3.Connection, job_id: str, peer: str, step: int) -> bool:
    """Keep `step` as the first `peer` was a member of `job_id` at, unless an earlier one is
    kept; False when it is not kept (its id is too long, or the job keeps `MAX_MEMBERS`).
    StoreError when the write fails."""
    if len(peer) > MAX_BANNED_ID:
        return False
    try:
        with transaction(db):
            if (
                db.execute(
                    "UPDATE members SET since = ? WHERE job = ? AND peer = ? AND since > ?",
                    (step, job_id, peer, step),
                ).rowcount
                or db.execute(
                    "SELECT 1 FROM members WHERE job = ? AND peer = ?", (job_id, peer)
                ).fetchone()
            ):
                return True
            held = db.execute("SELECT COUNT(*) FROM members WHERE job = ?", (job_id,)).fetchone()
            if held[0] >= MAX_MEMBERS:
                return False
            db.execute("INSERT INTO members VALUES (?, ?, ?)", (job_id, peer, step))
            return True
    except sqlite3.Error as e:
        raise write_failed(e, f"when {peer} joined job {job_id!r} not recorded ({e})") from e


def seen_of(db: sqlite3.Connection, job_id: str) -> dict[str, int]:
    """Each peer kept by `see` for `job_id`, with the first step it was a member at."""
    rows = db.execute("SELECT peer, since FROM members WHERE job = ?", (job_id,))
    return {r[0]: r[1] for r in rows}
