"""Peers given a stage that never served it: counted, said, and left out of the job's placement
after `NO_SHOWS` in a row.

Why: a stage server can drop an assignment without a word to the scheduler: its clock more than
`MAX_CLOCK_SKEW_S` behind the scheduler's (the assignment reads as forged, from the future), an
assignment older than one it took before (the scheduler's clock went back), a job it no longer
knows. It stays JOINING, measured; placement waited `serve_timeout_s` for it, gave up, and
offered it the same stage again: every five minutes, for ever, while the job's status said
"starting 1 stage server(s): X on stage k". Now each miss is logged at WARNING with the peer and
its stage, the job's waiting message names the peers left out and why, and a peer that missed
`NO_SHOWS` assignments of a job in a row is not given it again until it restarts (a new
incarnation: its clock or version fixed). A peer seen serving the job has no misses in a row."""

from __future__ import annotations

import logging
from dataclasses import dataclass

__all__ = ["NO_SHOWS", "NoShows"]

log = logging.getLogger(__name__)

NO_SHOWS = 3  # assignments of a job in a row a peer did not serve before it is left out
SHOWN = 3  # the peers left out a job's message names at most (the others counted)


@dataclass(frozen=True)
class _Missed:
    incarnation: str
    count: int
    stage: int


class NoShows:
    def __init__(self, serve_timeout_s: float) -> None:
        self.serve_timeout_s = serve_timeout_s
        self._missed: dict[tuple[str, str], _Missed] = {}  # (job, peer) -> its misses in a row

    def missed(self, job: str, peer: str, stage: int, incarnation: str) -> None:
        """`peer` (of `incarnation`) was given `stage` of `job` and did not serve it within
        `serve_timeout_s`."""
        before = self._missed.get((job, peer))
        count = before.count + 1 if before is not None and before.incarnation == incarnation else 1
        self._missed[(job, peer)] = _Missed(incarnation, count, stage)
        log.warning(
            "job %s: %s was given stage %d and did not serve it within %.0f s (%d of %d in a "
            "row; its log says why)%s",
            job,
            peer,
            stage,
            self.serve_timeout_s,
            count,
            NO_SHOWS,
            ": not given this job again until it restarts" if count == NO_SHOWS else "",
        )

    def served(self, job: str, peer: str) -> None:
        self._missed.pop((job, peer), None)

    def left_out(self, job: str, peer: str, incarnation: str) -> bool:
        """Whether placement leaves `peer` out of `job`: `NO_SHOWS` misses in a row, by the same
        process."""
        missed = self._missed.get((job, peer))
        return missed is not None and missed.incarnation == incarnation and missed.count >= NO_SHOWS

    def words(self, job: str, incarnations: dict[str, str]) -> str:
        """What the job's waiting message adds ("" when nobody present is left out):
        `incarnations`, the present peers' by id."""
        out = sorted(
            (peer, m.stage)
            for (j, peer), m in self._missed.items()
            if j == job and self.left_out(job, peer, incarnations.get(peer, "\0"))
        )
        if not out:
            return ""
        said = ", ".join(f"{peer} (stage {stage})" for peer, stage in out[:SHOWN])
        more = len(out) - SHOWN
        return (
            f"; left out after {NO_SHOWS} assignments in a row they did not serve: {said}"
            + (f" and {more} more" if more > 0 else "")
            + " (a clock far from the scheduler's? their logs say why)"
        )

    def keep(self, present: set[str]) -> None:
        """Forget the peers gone: bounded by who is here."""
        for key in [k for k in self._missed if k[1] not in present]:
            del self._missed[key]

    def forget(self, job: str) -> None:
        """An ended job's misses."""
        for key in [k for k in self._missed if k[0] == job]:
            del self._missed[key]
