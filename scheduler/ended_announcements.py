"""The newest ended jobs' announcements stay retained on the broker; older ones are cleared.

Why: a peer learns that a job ended from its retained announcement. One whose link to the broker
was down when the job ended, and stayed down past the sweep (`scheduler.retained`) that cleared
that announcement, never learned it (a subscriber is not told of a clear): it went on serving the
dead job for good, or took it up from its memory of the jobs announced, lost to every later job.
So an ended job's announcement (without its spec: a hundred bytes) is cleared only once `KEPT`
newer jobs have ended: a peer away across the ends of fewer jobs than that learns every one as it
reconnects, and the broker, and every fresh subscriber's backlog, hold `KEPT` of them at most.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["KEPT", "EndedAnnouncements"]

KEPT = 256  # ended jobs whose announcement the broker keeps: as many as a peer remembers ended


class EndedAnnouncements:
    """The ended jobs whose announcements stay retained, the newest last."""

    def __init__(self, kept: int | None = None) -> None:
        self.kept = KEPT if kept is None else kept
        self._jobs: OrderedDict[str, None] = OrderedDict()

    def seed(self, newest_first: Iterable[str]) -> None:
        """At a start: the ended jobs found, newest first (at most `kept` of them stay)."""
        for job_id in newest_first:
            if len(self._jobs) >= self.kept:
                break
            self._jobs[job_id] = None
            self._jobs.move_to_end(job_id, last=False)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def ended(self, job_id: str) -> list[str]:
        """`job_id` has ended: its announcement stays; the jobs whose announcements are to be
        cleared now to make room for it, the oldest first."""
        self._jobs[job_id] = None
        self._jobs.move_to_end(job_id)
        gone = []
        while len(self._jobs) > self.kept:
            gone.append(self._jobs.popitem(last=False)[0])
        return gone
