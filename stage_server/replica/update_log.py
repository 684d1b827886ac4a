"""The updates a replica applied, kept for the peers copying it (its followers).

A joining replica downloads this replica's state at some step s while training goes on; by the
time the download ends the pool has applied more steps. The follower then applies the same
updates (the pool's summed gradient of each step and the step's samples, in order) through the
same optimizer code, so it becomes bitwise identical without stopping anyone (see
docs/architecture.md, "Joining, leaving, moving").

Nothing is kept while nobody follows. The log is bounded in bytes: when it would grow past its
bound the oldest updates go, and a follower that still needed them must start its copy again.
What one caller can make a replica keep is bounded too, since a token holder may name itself a
follower of a replica no scheduler placed (under a scheduler only its tickets name followers,
`swarm.net.follow_tickets`): at most `max_followers` at once (another is refused until one is
done or gone), each forgotten after `ttl_s` unheard (its download and its asks for updates are
heard, `touch`).
And a place is held only by a peer that is copying (issue 44, N7: four fake downloads that hung
up after one message held every place for `ttl_s`, renewably): a download that ends before the
state is sent lets its follower go (`unfollow`), and one that took the state must ask for the
updates after it within `FIRST_ASK_S` (a joiner asks as soon as its copy is loaded), else it
is let go.

The log is read and written on the replica's worker thread, and touched from the event loop while
a download streams: a lock keeps the two apart.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from swarm.errors import FailedPrecondition, ResourceExhausted
from swarm.rpc.state_streams import Update

__all__ = ["UpdateLog"]


@dataclass
class _Follower:
    step: int  # the next step it needs
    heard: float  # when it was last heard from (the log's clock)
    since: int  # which `follow` registered it (a later download of the same name is another)
    sent: float | None = None  # when its download ended, until it first asks for updates


class UpdateLog:
    FOLLOWER_TTL_S = 3600.0  # a follower not heard from this long is gone (it died mid-copy)
    MAX_FOLLOWERS = 4  # peers copying this replica at once
    # A follower that took the state asks for its updates within this (its copy loads locally,
    # in seconds), else it is gone: no copy follows.
    FIRST_ASK_S = 60.0

    def __init__(
        self,
        max_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_followers: int = MAX_FOLLOWERS,
        ttl_s: float = FOLLOWER_TTL_S,
    ) -> None:
        self.max_bytes, self._clock = max_bytes, clock
        self.max_followers, self.ttl_s = max_followers, ttl_s
        self.first_ask_s = self.FIRST_ASK_S
        self._updates: list[Update] = []
        self._first = 0  # the first step the log still has (or will have) an update of
        self._followers: dict[str, _Follower] = {}
        self._registered = 0  # `follow`s so far: each registration's own number
        self._lock = threading.Lock()
        # Told (on the worker's thread) as each update is kept: the asks waiting for one (a
        # long poll, `stage_server.replica.state_transfer`).
        self._watchers: set[Callable[[], None]] = set()

    def __len__(self) -> int:
        return len(self._updates)

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self._updates)

    def bound(self, max_bytes: int, max_followers: int, ttl_s: float) -> None:
        """This peer's bounds (`stage_server.replica.messages.Limits`): the most bytes kept,
        followers at once, and seconds a silent follower is kept for."""
        with self._lock:
            self.max_bytes, self.max_followers, self.ttl_s = max_bytes, max_followers, ttl_s
            self._forget_silent()
            self._drop_oldest()

    def follow(self, follower: str, step: int) -> int:
        """`follower` takes this replica's state at `step`: keep every update from `step` on.
        ResourceExhausted when `max_followers` others follow already. Returns the registration,
        which its download ends with (`sent`, or `unfollow` when it ended early)."""
        with self._lock:
            self._forget_silent()
            if follower not in self._followers and len(self._followers) >= self.max_followers:
                raise ResourceExhausted(
                    f"{len(self._followers)} peers are copying this replica already, the most "
                    f"it keeps updates for (--max-followers {self.max_followers}): copy another "
                    "replica, or this one later"
                )
            if not self._followers:
                self._updates, self._first = [], step
            self._first = min(self._first, step)
            self._registered += 1
            self._followers[follower] = _Follower(step, self._clock(), self._registered)
            return self._registered

    def sent(self, follower: str, registration: int) -> None:
        """`follower`'s download (`registration`) sent the whole state: it asks for the updates
        after it within `first_ask_s`, or is let go."""
        with self._lock:
            f = self._followers.get(follower)
            if f is not None and f.since == registration:
                f.sent = self._clock()

    def unfollow(self, follower: str, registration: int) -> None:
        """`follower`'s download (`registration`) ended before the state was sent (it hung up,
        or failed): no copy follows from it, and its place is free at once."""
        with self._lock:
            f = self._followers.get(follower)
            if f is not None and f.since == registration:
                del self._followers[follower]
                self._trim()

    def touch(self, follower: str) -> None:
        """`follower` was heard from (its download goes on): it is not silent."""
        with self._lock:
            if follower in self._followers:
                self._followers[follower].heard = self._clock()

    @property
    def followed(self) -> bool:
        """Whether a peer follows this replica now (what it applies is kept for it)."""
        with self._lock:
            return bool(self._followers)

    def record(self, update: Update) -> None:
        """This replica applied `update` (`update.scale * grad_sums / total_samples` at its
        step, or a round's end before it): kept, a copy on the CPU, while a peer follows; as
        the averaging's codec carried it where one did (`Update.encoded`: those bytes alone,
        its sums not copied)."""
        with self._lock:
            self._forget_silent()
            if not self._followers:
                return
        cpu = [] if update.encoded else [g.detach().to("cpu", copy=True) for g in update.grad_sums]
        with self._lock:  # (the copy made outside it)
            if not self._followers:
                return
            self._updates.append(replace(update, grad_sums=cpu))
            self._drop_oldest()
            watchers = list(self._watchers)
        for wake in watchers:
            wake()

    def watch(self, wake: Callable[[], None]) -> None:
        """`wake()` as each update is kept from now on, until `unwatch`; called on the thread that
        records, so it must only hand the news over (`loop.call_soon_threadsafe`)."""
        with self._lock:
            self._watchers.add(wake)

    def unwatch(self, wake: Callable[[], None]) -> None:
        with self._lock:
            self._watchers.discard(wake)

    def since(self, follower: str, step: int) -> list[Update]:
        """The updates from `step` on, for `follower`, who has every one before `step` (those
        may be forgotten once no follower needs them). A negative `step`: the follower is done."""
        with self._lock:
            if step < 0:
                self._followers.pop(follower, None)
                self._trim()
                return []
            self._forget_silent()
            if follower not in self._followers:
                raise FailedPrecondition(f"{follower} does not follow this replica: copy it again")
            if step < self._first:
                del self._followers[follower]
                self._trim()  # what it alone held on to goes too
                raise FailedPrecondition(
                    f"updates from step {step} are no longer kept (the log starts at "
                    f"{self._first}; it holds at most {self.max_bytes} bytes): copy the state again"
                )
            f = self._followers[follower]
            f.step, f.heard, f.sent = step, self._clock(), None  # asked: copying
            self._trim()
            return [u for u in self._updates if u.step >= step]

    def clear(self) -> None:
        """This replica's state was replaced (a rollback, a copy): its followers start again."""
        with self._lock:
            self._updates, self._followers = [], {}

    def _drop_oldest(self) -> None:
        while len(self._updates) > 1 and self.nbytes > self.max_bytes:
            dropped = self._updates.pop(0)
            # A round's end is before its step's own update: that step is still whole then
            # only for a follower that applied the round's end; say it is gone, to be safe.
            self._first = dropped.step + 1

    def _trim(self) -> None:
        if not self._followers:
            self._updates = []
            return
        needed = min(f.step for f in self._followers.values())
        self._updates = [u for u in self._updates if u.step >= needed]
        self._first = max(self._first, needed)

    def _forget_silent(self) -> None:
        now = self._clock()
        horizon, asked_by = now - self.ttl_s, now - min(self.first_ask_s, self.ttl_s)
        silent = [
            p
            for p, f in self._followers.items()
            if f.heard < horizon or (f.sent is not None and f.sent < asked_by)
        ]
        for peer in silent:
            del self._followers[peer]
        if silent:
            self._trim()  # what they alone held on to goes too
