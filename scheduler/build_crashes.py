"""Peers that went away while building the stage they were given: said, counted across their
restarts, and paused out of the job after `CRASHES` in a row.

Why: a stage server killed while it builds its stage (the kernel's out-of-memory killer, a
segfault, a device fault) left no word. Placement waited out `serve_timeout_s` (five minutes)
for a peer that was gone, and a supervisor that restarts it (compose's `restart:
unless-stopped`) had it measured, placed and killed again, for ever, while the job's status said
"starting 1 stage server(s): X on stage k". `scheduler.no_shows` counts a peer that stays and
does not serve, by one process; a restart is a new process, so these are counted by peer id.
Now each loss is said at WARNING with the peer and its stage, placement goes on at once, and a
peer lost `CRASHES` times in a row while building a job's stage is not given that job again for
`PAUSE_S` (its operator's fix, more memory say, is tried then; one more loss pauses it again).
Seen serving the job, its count starts again."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from swarm.clock import Clock

__all__ = ["CRASHES", "PAUSE_S", "BuildCrashes"]

log = logging.getLogger(__name__)

CRASHES = 3  # losses in a row while building a job's stage before the peer is paused out of it
PAUSE_S = 3600.0  # how long it is then left out of that job (s)
SHOWN = 3  # the paused peers a job's message names at most (the others counted)
# (job, peer) pairs remembered, least recently lost forgotten first: any token holder may come
# and go under new ids, and what they leave here must not grow with them
KEPT = 1024


@dataclass(frozen=True)
class _Lost:
    count: int  # in a row
    stage: int
    at: float  # the last loss, on the registry's clock


class BuildCrashes:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._lost: OrderedDict[tuple[str, str], _Lost] = OrderedDict()

    def lost(self, job: str, peer: str, stage: int) -> None:
        """`peer` went away (its last will, or a stop) before it served `stage` of `job`."""
        before = self._lost.pop((job, peer), None)
        count = before.count + 1 if before is not None else 1
        self._lost[(job, peer)] = _Lost(count, stage, self.clock.now())
        while len(self._lost) > KEPT:
            self._lost.popitem(last=False)
        log.warning(
            "job %s: %s went away while building stage %d (stopped, or killed: out of memory "
            "is the usual cause; its log, or the kernel's, says) (%d of %d in a row)%s",
            job,
            peer,
            stage,
            count,
            CRASHES,
            f": not given this job again for {PAUSE_S:.0f} s" if count >= CRASHES else "",
        )

    def served(self, job: str, peer: str) -> None:
        self._lost.pop((job, peer), None)

    def left_out(self, job: str, peer: str) -> bool:
        """Whether placement leaves `peer` out of `job` now: paused after `CRASHES` in a row."""
        lost = self._lost.get((job, peer))
        return lost is not None and lost.count >= CRASHES and self.clock.now() - lost.at < PAUSE_S

    def words(self, job: str) -> str:
        """What the job's waiting message adds ("" when nobody is paused out of it)."""
        out = sorted(
            (peer, lost.stage, lost.at)
            for (j, peer), lost in self._lost.items()
            if j == job and self.left_out(job, peer)
        )
        if not out:
            return ""
        now, wall = self.clock.now(), time.time()
        said = ", ".join(
            f"{peer} (stage {stage}, until "
            f"{time.strftime('%H:%M:%S', time.localtime(wall - (now - at) + PAUSE_S))})"
            for peer, stage, at in out[:SHOWN]
        )
        more = len(out) - SHOWN
        return (
            f"; left out after going away {CRASHES} times in a row while building their stage: "
            f"{said}" + (f" and {more} more" if more > 0 else "") + " (out of memory? their "
            "logs say why)"
        )

    def forget(self, job: str) -> None:
        """An ended job's losses."""
        for key in [k for k in self._lost if k[0] == job]:
            del self._lost[key]
