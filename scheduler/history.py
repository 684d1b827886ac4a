"""Each job's history for operators: what happened to it and why, kept in the job store
(`JobStore.record_event`), said once in the scheduler's log, shown by `swarm status` (its newest
events) and by `--watch` from the start.

Peers' comings and goings are read off their announcements (`peer_events`): a peer that joins a
stage, moves (it drains its stage, then serves another: one move, not a leave and a restart),
leaves (its last-will: killed, crashed or cut off; or a clean stop), and one that
comes back under the id of a peer that left reads by its announced incarnation (its process's
start id): the same process reconnected (its link or the broker's dropped, and came back), a new
one restarted (a replacement server from the same cache directory, or the same one restarted),
not as if the dead peer had come back; a peer that announces no incarnation is "back", either.

An announcement is the peer's own claim: it names whatever job and stage it likes, as often as it
likes. So a peer's events are recorded only for a job the scheduler vouches for it in (`vouched`:
it gave the peer a stage of the job, or admitted it as a member), never for a job it merely names;
and each peer's events (its admissions too) are rated (`PEER_BURST`, then one per `PEER_EVERY_S`):
a peer that flips its announcement many times a second costs a few store writes and log lines,
and the next one recorded says how many were left out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

from scheduler.store import JobRecord, JobStore, StoreError
from swarm.job.states import JobState
from swarm.ops.progress import duration_text
from swarm.ops.rated import RatedLog
from swarm.proto import control_pb2 as cpb

__all__ = [
    "PEER_BURST",
    "PEER_EVERY_S",
    "Back",
    "History",
    "Vouched",
    "admitted_text",
    "back_as",
    "peer_events",
    "state_change_text",
]

log = logging.getLogger(__name__)

# Peers remembered as gone, per job: ids are what peers call themselves, so a stream of made-up
# ones must not grow the scheduler; the oldest are forgotten (a restart then reads as a join).
MAX_REMEMBERED = 10_000

#: Each peer's events: this many at once, then one per `PEER_EVERY_S` (what a peer's honest
#: comings and goings never reach: a join, an admission, a move, a leave).
PEER_BURST, PEER_EVERY_S = 8, 30.0

#: `vouched(job, peer)`: whether the scheduler itself put `peer` on `job` (gave it a stage of the
#: job, or admitted it as a member): only then does what the peer announces count for the job.
Vouched = Callable[[str, str], bool]

#: Kinds logged as warnings: training stopped, or is at risk of losing steps.
_ALARMING = frozenset({"stall", "warning", "rollback", "ban"})

#: (job, kind, text)
Event = tuple[str, str, str]


def _serving(
    a: cpb.PeerAnnouncement | None, states: tuple[int, ...] = (cpb.PEER_STATE_SERVING,)
) -> tuple[str, int] | None:
    """(job, stage) the peer serves per `a` (in one of `states`), or None."""
    if a is None or a.state not in states or not a.job or not a.HasField("stage"):
        return None
    return a.job, a.stage


#: A peer draining its stage still holds it: it moves (rebalancing) and serves its new stage next.
_HOLDING = (cpb.PEER_STATE_SERVING, cpb.PEER_STATE_DRAINING)


#: How a peer that left is back: the same process, a new one, or it does not say (no incarnation).
Back = Literal["", "reconnected", "restarted", "unknown"]


def back_as(left: str | None, incarnation: str) -> Back:
    """How a peer is back under its id: `left`, the incarnation it left with ("" unknown, None:
    it did not leave); `incarnation`, the one it announces now."""
    if left is None:
        return ""
    if not left or not incarnation:
        return "unknown"
    return "reconnected" if left == incarnation else "restarted"


_BACK = {
    "reconnected": "reconnected (the same process: its link or the broker's dropped)",
    "restarted": "restarted (a new process under the id of the one that left)",
    "unknown": "restarted or reconnected (it does not announce which)",
}


def peer_events(
    old: cpb.PeerAnnouncement | None, new: cpb.PeerAnnouncement, back: Back = ""
) -> list[Event]:
    """What a peer's announcement `new` (after `old`, None for a peer not present) tells of the
    jobs it served or serves. `back`: how the peer is back under this id after it left."""
    peer = new.peer
    was, now = _serving(old, _HOLDING), _serving(new)
    if new.state == cpb.PEER_STATE_DRAINING and was == _serving(new, _HOLDING):
        return []  # a move begins: said as a move once it serves its new stage
    if new.state == cpb.PEER_STATE_OFFLINE:
        if was is None:
            return []
        # A last-will is registered before the peer knows the time it will be sent: it carries
        # none. A peer that stops cleanly announces itself with the time.
        cause = (
            "its connection dropped (killed, crashed or cut off from the broker)"
            if new.time == 0
            else "it was stopped"
        )
        return [(was[0], "leave", f"{peer} left stage {was[1]}: {cause}")]
    if was == now:
        return []
    events: list[Event] = []
    if was is not None and (now is None or now[0] != was[0]):
        events.append((was[0], "leave", f"{peer} stopped serving stage {was[1]}"))
    if now is not None:
        if was is not None and was[0] == now[0]:
            events.append((now[0], "move", f"{peer} moved from stage {was[1]} to stage {now[1]}"))
        elif back:
            kind = "reconnect" if back == "reconnected" else "restart"
            text = f"{peer} is back, {_BACK[back]}, and serves stage {now[1]}"
            events.append((now[0], kind, text))
        else:
            events.append((now[0], "join", f"{peer} joined stage {now[1]}"))
    return events


def admitted_text(step: int, stage: int, peer: str, source: str) -> str:
    """The event of `peer` becoming a member of `stage` at `step`: from then on it counts (it
    served before, but held no state of the job's yet)."""
    how = f"a copy of {source}" if source else "it answered at the job's step"
    return f"{peer} counts as a replica of stage {stage} from step {step} ({how})"


class History:
    """Writes jobs' events to the store and the log; remembers peers that left each job, so that
    one coming back reads as a reconnection or a restart."""

    def __init__(
        self,
        store: JobStore,
        *,
        vouched: Vouched = lambda job, peer: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`vouched`: by default nobody (no peer's announcement is recorded)."""
        self.store, self.vouched = store, vouched
        # job -> peers that left it, oldest first, with the incarnation each left with (bounded)
        self._left: dict[str, dict[str, str]] = {}
        self._quota = _PeerQuota(clock)
        self._rated = RatedLog(log, every_s=PEER_EVERY_S, clock=clock)

    def record(self, job_id: str, kind: str, text: str) -> None:
        level = logging.WARNING if kind in _ALARMING else logging.INFO
        log.log(level, "job %s: %s", job_id, text)
        try:
            self.store.record_event(job_id, kind, text)
        except StoreError as e:  # a full disk: the log has it; training goes on
            log.error("%s", e)

    def peer(self, old: cpb.PeerAnnouncement | None, new: cpb.PeerAnnouncement) -> None:
        """Record what `new` (the peer's announcement after `old`) tells of the jobs the
        scheduler vouches for it in."""
        job = new.job or (old.job if old is not None else "")
        back = back_as(self._left.get(job, {}).get(new.peer), new.incarnation) if job else ""
        for job_id, kind, text in peer_events(old, new, back):
            if not self.vouched(job_id, new.peer):
                continue  # a job it only names: its claim is not the job's history
            record = self.store.get(job_id)
            if record is None or record.finished:
                continue  # deleted (or another scheduler's); or ended: its peers are released
            left = self._left.setdefault(job_id, {})
            if kind == "leave":  # its last-will carries its incarnation; else its last word
                left[new.peer] = new.incarnation or (old.incarnation if old is not None else "")
                if len(left) > MAX_REMEMBERED:
                    del left[next(iter(left))]
            elif kind in ("join", "restart", "reconnect"):
                left.pop(new.peer, None)
            self._rated_record(job_id, new.peer, kind, text)

    def admitted(self, job_id: str, step: int, stage: int, peer: str, source: str) -> None:
        """`peer` became a member of `stage` at `step` (`Membership.admitted`)."""
        self._rated_record(job_id, peer, "join", admitted_text(step, stage, peer, source))

    def _rated_record(self, job_id: str, peer: str, kind: str, text: str) -> None:
        """`record`, within `peer`'s quota; the next one recorded says what was left out."""
        held = self._quota.take(peer)
        if held is None:
            self._rated.warning(
                ("history", peer),
                "job %s: %s changes its announcement too often: its events are not recorded "
                "for now (at most %d, then one per %.0f s)",
                job_id,
                peer,
                PEER_BURST,
                PEER_EVERY_S,
            )
            return
        if held:
            text += f" ({held} earlier change(s) of {peer} not recorded: too frequent)"
        self.record(job_id, kind, text)

    def forget(self, job_id: str) -> None:
        """The job ended: nothing more to tell apart."""
        self._left.pop(job_id, None)


class _PeerQuota:
    """A token bucket per peer (`PEER_BURST`, refilled one per `PEER_EVERY_S`), with the count of
    events it refused since the last it allowed; for at most `MAX_REMEMBERED` peers (the ones
    heard from longest ago are forgotten: a full bucket again)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._peers: dict[str, tuple[float, float, int]] = {}  # peer -> (tokens, at, refused)

    def take(self, peer: str) -> int | None:
        """None: refused; else allowed, with how many were refused before it."""
        now = self.clock()
        tokens, at, refused = self._peers.pop(peer, (float(PEER_BURST), now, 0))
        tokens = min(float(PEER_BURST), tokens + (now - at) / PEER_EVERY_S)
        allowed = tokens >= 1.0
        self._peers[peer] = (tokens - 1.0, now, 0) if allowed else (tokens, now, refused + 1)
        if len(self._peers) > MAX_REMEMBERED:
            del self._peers[next(iter(self._peers))]
        return refused if allowed else None


def state_change_text(record: JobRecord, state: JobState, message: str) -> str:
    """The event of `record`'s job becoming `state`."""
    if state == "succeeded":
        took = time.time() - record.created
        loss = f"{record.loss:.4f}"
        return f"succeeded: {record.steps} steps, loss {loss}, {duration_text(took)} after submit"
    return f"{record.state} -> {state}" + (f": {message}" if message else "")
