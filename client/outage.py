"""A scheduler that does not answer, as the views (`swarm submit --wait`, `swarm status --watch`)
live through it: since when, the pause before asking again (`swarm.policy.backoff`), and when to
give up. A home network blip (15 to 60 s of a router reconnecting) or a scheduler restarting
must not end a view that the job outlives: the view says "scheduler unreachable since HH:MM:SS
(N s): retrying" in place and goes on once it answers.

Pure state on an injected clock: the client (`SchedulerClient.get_through`) asks, this decides.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from swarm.ops.progress import duration_text
from swarm.policy.backoff import Backoff

__all__ = ["WAIT_RETRY_S", "WATCH_RETRY_S", "Outage"]

# `submit --wait` is run by scripts: after an hour without an answer, exit 1 and say so rather
# than hang a pipeline forever. `status --watch` is a person's view: it never gives up (Ctrl-C).
WAIT_RETRY_S = 3600.0
WATCH_RETRY_S = math.inf


def _pauses() -> Backoff:
    # Short at first (a blip is over in seconds), at most 10 s apart: a scheduler back after a
    # minute is seen within seconds, and a view polling a dead one costs it nothing.
    return Backoff(first_s=0.5, cap_s=10.0)


@dataclass
class Outage:
    """The scheduler's silence, followed across the asks of one view. `retry_for_s`: how long it
    may last before the view gives up (`math.inf`: never)."""

    retry_for_s: float
    clock: Callable[[], float] = time.time  # wall time: "since" is a time of day
    backoff: Backoff = field(default_factory=_pauses)
    # When the scheduler went silent: its last answer (issue 68 item 5: a home's outage is
    # stamped from there, not from the moment an ask's deadline ran out, 30 s later).
    since: float | None = None
    last_answer: float | None = None  # when it last answered this view (None: never yet)

    def overdue(self) -> float:
        """An ask is still unanswered after the view's notice (`SchedulerClient.get_through`):
        the outage has begun, since the last answer (returned); the ask may still come back."""
        if self.since is None:
            self.since = self.last_answer if self.last_answer is not None else self.clock()
        return self.since

    def failed(self) -> float | None:
        """An ask went unanswered just now: the pause before the next one, or None when the
        outage has lasted `retry_for_s` (give up)."""
        now = self.clock()
        if now - self.overdue() >= self.retry_for_s:
            return None
        return self.backoff.next()

    def answered(self) -> float | None:
        """The scheduler answered: how long the outage it ends lasted (None: there was none)."""
        since, self.since = self.since, None
        self.last_answer = self.clock()
        self.backoff.reset()
        return None if since is None else self.clock() - since

    def text(self) -> str:
        """What a view shows while it lasts."""
        since = self.since if self.since is not None else self.clock()
        at = time.strftime("%H:%M:%S", time.localtime(since))
        return f"scheduler unreachable since {at} ({self.clock() - since:.0f} s): retrying"

    def gave_up(self) -> str:
        """Why the view ends: the outage outlasted its bound."""
        return f"no answer for {duration_text(self.retry_for_s)} (--retry-for): giving up"
