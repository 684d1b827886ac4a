"""A job's `BanBook` in the scheduler's job store (`scheduler.store_bans`): the bans its
coordinator makes, and when each member first was one, are kept there, and each coordinator
built for the job afterwards (another attempt, a restarted scheduler) starts with them
(`scheduler.coordinator.trust.bans`).

A write the store refuses (a full disk) is held here and written at the next use, once there is
room: one book serves every attempt at a job while any of its writes waits
(`scheduler.job_training`), so the next attempt still starts with the ban. Before, the ban held
for the coordinator that made it only, and the banned peer was a member again at the next
attempt (any lost stage ends one)."""

from __future__ import annotations

import logging

from scheduler.coordinator.trust.standing import Ban
from scheduler.store import BanRow, JobStore, StoreError
from scheduler.store_bans import MAX_BANNED_ID, MAX_BANS, MAX_MEMBERS

__all__ = ["StoredBans"]

log = logging.getLogger(__name__)


class StoredBans:
    def __init__(self, store: JobStore, job_id: str, binds_credentials: bool = False) -> None:
        """`binds_credentials`: peer ids are bound to certificates (`BanBook`)."""
        self.store, self.job_id, self.binds_credentials = store, job_id, binds_credentials
        self._unkept_said = False  # members past what the store keeps: said once
        self._bans: dict[str, Ban] = {}  # by peer: bans not written yet, the oldest first
        self._seen: dict[str, int] = {}  # when members first were, not written yet

    @property
    def waiting(self) -> bool:
        """Whether a ban or a member's first step waits to be written."""
        return bool(self._bans or self._seen)

    def kept(self) -> list[Ban]:
        self._write_waiting()
        stored = [
            Ban(r.peer, r.stage, r.step, r.since, r.reason, r.replayed)
            for r in self.store.bans(self.job_id)
        ]
        return stored + list(self._bans.values())

    def seen(self) -> dict[str, int]:
        self._write_waiting()
        seen = self.store.seen(self.job_id)
        for peer, step in self._seen.items():
            seen[peer] = min(step, seen.get(peer, step))
        return seen

    def see(self, peer: str, step: int) -> None:
        self._seen[peer] = min(step, self._seen.get(peer, step))
        self._write_waiting(said=True)

    def keep(self, ban: Ban) -> None:
        self._bans.setdefault(ban.peer, ban)
        self._write_waiting(said=True)

    def _write_waiting(self, said: bool = False) -> None:
        """Write what waits, the oldest first, until the store refuses one (said at ERROR where
        `said`: a new ban or member's write, not each retry of it)."""
        try:
            for peer, ban in list(self._bans.items()):
                self._write_ban(ban)
                del self._bans[peer]
            for peer, step in list(self._seen.items()):
                self._write_seen(peer, step)
                del self._seen[peer]
        except StoreError as e:  # a full disk: held here, written once there is room
            if said:
                log.error(
                    "job %s: %s; held by this scheduler and written once the store has room "
                    "(%d bans and %d members waiting)",
                    self.job_id,
                    e,
                    len(self._bans),
                    len(self._seen),
                )

    def _write_seen(self, peer: str, step: int) -> None:
        if self.store.record_seen(self.job_id, peer, step) or self._unkept_said:
            return
        self._unkept_said = True
        log.warning(
            "job %s: when %.64s joined is not kept in the job store (a job keeps %d members "
            "at most): after a restart a ban of it rolls back as far as its doubt window",
            self.job_id,
            peer,
            MAX_MEMBERS,
        )

    def _write_ban(self, ban: Ban) -> None:
        row = BanRow(ban.peer, ban.stage, ban.step, ban.since, ban.evidence, ban.replayed)
        if self.store.record_ban(self.job_id, row):
            return
        log.warning(
            "job %s: the ban of %.64s is not kept in the job store (a job keeps %d bans at "
            "most, and ids of up to %d characters): it holds until the scheduler restarts",
            self.job_id,
            ban.peer,
            MAX_BANS,
            MAX_BANNED_ID,
        )
