"""A job's `BanBook` in the scheduler's job store (`scheduler.store_bans`): the bans its
coordinator makes, and when each member first was one, are kept there, and each coordinator
built for the job afterwards (another attempt, a restarted scheduler) starts with them
(`scheduler.coordinator.trust.bans`)."""

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

    def kept(self) -> list[Ban]:
        return [
            Ban(r.peer, r.stage, r.step, r.since, r.reason, r.replayed)
            for r in self.store.bans(self.job_id)
        ]

    def seen(self) -> dict[str, int]:
        return self.store.seen(self.job_id)

    def see(self, peer: str, step: int) -> None:
        try:
            kept = self.store.record_seen(self.job_id, peer, step)
        except StoreError as e:  # a full disk: a restart takes the peer as present from step 0
            log.error("job %s: %s; a restart takes it as a member from step 0", self.job_id, e)
            return
        if not kept and not self._unkept_said:
            self._unkept_said = True
            log.warning(
                "job %s: when %.64s joined is not kept in the job store (a job keeps %d members "
                "at most): after a restart a ban of it rolls back as far as its doubt window",
                self.job_id,
                peer,
                MAX_MEMBERS,
            )

    def keep(self, ban: Ban) -> None:
        row = BanRow(ban.peer, ban.stage, ban.step, ban.since, ban.evidence, ban.replayed)
        try:
            kept = self.store.record_ban(self.job_id, row)
        except StoreError as e:  # a full disk: the ban holds while this coordinator does
            log.error("job %s: %s; it holds until the scheduler restarts", self.job_id, e)
            return
        if not kept:
            log.warning(
                "job %s: the ban of %.64s is not kept in the job store (a job keeps %d bans at "
                "most, and ids of up to %d characters): it holds until the scheduler restarts",
                self.job_id,
                ban.peer,
                MAX_BANS,
                MAX_BANNED_ID,
            )
