"""Each job's history for operators: what happened to it and why, kept in the job store
(`JobStore.record_event`), said once in the scheduler's log, shown by `swarm status` (its newest
events) and by `--watch` from the start.

Peers' comings and goings are read off their announcements (`peer_events`): a peer that joins a
stage, moves (it drains its stage, then serves another: one move, not a leave and a restart),
leaves (its last-will: killed, crashed or cut off; or a clean stop), and one that
comes back under the id of a peer that left (a replacement server from the same cache directory,
or the same one restarted) reads as a restart, not as if the dead peer had come back.
"""

from __future__ import annotations

import logging
import time

from scheduler.store import JobRecord, JobStore, StoreError
from swarm.job.states import JobState
from swarm.ops.progress import duration_text
from swarm.proto import control_pb2 as cpb

__all__ = ["History", "admitted_text", "peer_events", "state_change_text"]

log = logging.getLogger(__name__)

# Peers remembered as gone, per job: ids are what peers call themselves, so a stream of made-up
# ones must not grow the scheduler; the oldest are forgotten (a restart then reads as a join).
MAX_REMEMBERED = 10_000

#: Kinds logged as warnings: training stopped, or is at risk of losing steps.
_ALARMING = frozenset({"stall", "warning", "rollback"})

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


def peer_events(
    old: cpb.PeerAnnouncement | None, new: cpb.PeerAnnouncement, restarted: bool = False
) -> list[Event]:
    """What a peer's announcement `new` (after `old`, None for a peer not present) tells of the
    jobs it served or serves. `restarted`: the peer left before under this id."""
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
        elif restarted:
            events.append(
                (
                    now[0],
                    "restart",
                    f"{peer} is back, restarted (a new process under the id of the one that "
                    f"left), and serves stage {now[1]}",
                )
            )
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
    one coming back reads as a restart."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        # job -> peers that left it, oldest first (a dict as an ordered set, bounded)
        self._left: dict[str, dict[str, None]] = {}

    def record(self, job_id: str, kind: str, text: str) -> None:
        level = logging.WARNING if kind in _ALARMING else logging.INFO
        log.log(level, "job %s: %s", job_id, text)
        try:
            self.store.record_event(job_id, kind, text)
        except StoreError as e:  # a full disk: the log has it; training goes on
            log.error("%s", e)

    def peer(self, old: cpb.PeerAnnouncement | None, new: cpb.PeerAnnouncement) -> None:
        """Record what `new` (the peer's announcement after `old`) tells."""
        job = new.job or (old.job if old is not None else "")
        restarted = bool(job) and new.peer in self._left.get(job, {})
        for job_id, kind, text in peer_events(old, new, restarted):
            record = self.store.get(job_id)
            if record is None or record.finished:
                continue  # deleted (or another scheduler's); or ended: its peers are released
            left = self._left.setdefault(job_id, {})
            if kind == "leave":
                left[new.peer] = None
                if len(left) > MAX_REMEMBERED:
                    del left[next(iter(left))]
            elif kind in ("join", "restart"):
                left.pop(new.peer, None)
            self.record(job_id, kind, text)

    def forget(self, job_id: str) -> None:
        """The job ended: nothing more to tell apart."""
        self._left.pop(job_id, None)


def state_change_text(record: JobRecord, state: JobState, message: str) -> str:
    """The event of `record`'s job becoming `state`."""
    if state == "succeeded":
        took = time.time() - record.created
        loss = f"{record.loss:.4f}"
        return f"succeeded: {record.steps} steps, loss {loss}, {duration_text(took)} after submit"
    return f"{record.state} -> {state}" + (f": {message}" if message else "")
