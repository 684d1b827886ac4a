"""A job's standing with its peers (issue 55, 64): who is banned and why, where ids bind
credentials every id a banned peer's credential certifies, and the first step each peer was a
member at (where a ban's rollback may start). It is the one filter every view of the members
goes through (`members`: trainers, rounds, rollbacks, checkpoints), made before the views that
use it and before the `Bans` that act on it (`scheduler.coordinator.trust.bans`), so that those
are given their rollback and voids when they are made. What it holds outlives its coordinator in
a `BanBook` (the scheduler's job store), which it starts from."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from swarm.net.peer_names import BarredIds
from swarm.rpc.lease import Replica

__all__ = ["Ban", "BanBook", "Members", "Standing"]

log = logging.getLogger(__name__)

Members = Callable[[], list[list[Replica]]]


@dataclass(frozen=True)
class Ban:
    """A ban as kept beyond its coordinator."""

    peer: str
    stage: int
    step: int  # the step it was caught at
    since: int  # the first step its work may be in: its rollback goes to a checkpoint at or before
    evidence: str
    replayed: bool = False  # its rollback has run: the job's state holds none of its work
    by: str = "an audit"  # what caught it (not kept: said once, when it is made)

    @property
    def text(self) -> str:
        """The ban as the log, the job's history and `swarm status` say it."""
        return (
            f"banned {self.peer} (stage {self.stage}): {self.by} caught it lying: "
            f"{self.evidence}; rolling back to the last checkpoint at or before step "
            f"{self.since}, the first it could have lied at unseen, and training again without it"
        )


class BanBook(Protocol):
    """Where a job's bans outlive its coordinator (the scheduler's job store)."""

    #: peer ids are bound to certificates (the broker's users are their certificates' names):
    #: a ban bars every id its credential certifies (`swarm.net.peer_names.barred`)
    binds_credentials: bool

    def kept(self) -> list[Ban]:
        """The job's bans made by the coordinators before this one."""
        ...

    def keep(self, ban: Ban) -> None:
        """Keep `ban` (durably, before its rollback starts); a write that fails is logged,
        and the ban holds as long as this coordinator."""
        ...

    def seen(self) -> dict[str, int]:
        """The first step each peer was a member of the job at, as `see` kept it."""
        ...

    def see(self, peer: str, step: int) -> None:
        """Keep `step` as the first `peer` was a member at (unless an earlier one is kept); a
        write that fails is logged, and a restart takes the peer as present from step 0."""
        ...


class Standing:
    """Who is banned from job `job_id`, and when each peer came; started from `book` (None:
    nothing kept, a ban lasts as long as its coordinator)."""

    def __init__(self, job_id: str, book: BanBook | None = None) -> None:
        self.job_id, self.book = job_id, book
        self.banned: dict[str, str] = {}  # peer -> the evidence
        self.caught_at: dict[str, int] = {}  # peer -> the step of the microbatch it was caught at
        # peer -> the first step it was a member at, kept in `book` across coordinators
        self.first_seen: dict[str, int] = dict(book.seen()) if book is not None else {}
        self.kept: list[Ban] = book.kept() if book is not None else []  # by coordinators before
        self.binds = book is not None and book.binds_credentials  # ids bind credentials
        self._barred = BarredIds(self.binds)  # the banned ids, and their credentials' ids
        for ban in self.kept:
            self.bar(ban.peer, ban.evidence, ban.step)
        if self.banned:
            shown = ", ".join(list(self.banned)[:10]) + (", ..." if len(self.banned) > 10 else "")
            log.warning("job %s: %d banned before, still: %s", job_id, len(self.banned), shown)

    def members(self, members: Members) -> Members:
        """`members` without the banned peers (and, where ids bind credentials, without every
        id of a banned peer's credential)."""
        return lambda: [[r for r in stage if not self.bars(r.peer)] for stage in members()]

    def bars(self, peer: str) -> bool:
        """Whether `peer` is no member: banned, or certified by a banned one's credential."""
        return peer in self.banned or peer in self._barred

    def bar(self, peer: str, evidence: str, step: int) -> None:
        """`peer` is banned from now on, caught at `step`."""
        self.banned[peer], self.caught_at[peer] = evidence, step
        self._barred.add(peer)

    def came(self, peer: str, step: int) -> None:
        """`peer` was a member at `step`, before any step known so far: kept in the book too."""
        self.first_seen[peer] = step
        if self.book is not None:
            self.book.see(peer, step)

    def keep(self, ban: Ban) -> None:
        """Keep `ban` in the book (before its rollback starts: a restart meanwhile runs it)."""
        if self.book is not None:
            self.book.keep(ban)
