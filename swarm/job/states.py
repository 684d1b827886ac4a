"""Job and peer states: the names the store, the CLI and the metrics use, and their protobuf enums
(`control.proto`), converted both ways here and nowhere else; and the moves a job's state may
make (the store refuses others)."""

from __future__ import annotations

from typing import Literal, get_args

from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from swarm.proto import control_pb2 as cpb

__all__ = [
    "JOB_STATES",
    "TERMINAL",
    "TERMINAL_PROTO",
    "UNFINISHED",
    "JobState",
    "job_state_name",
    "job_state_proto",
    "may_move",
    "moves",
    "peer_state_name",
]

# "stalled": running, but a stage has no replica (no microbatch crosses it) until it is served
# again, or no step committed for the job's patience (its message names the last failure) until
# one does; not an end.
JobState = Literal["queued", "placing", "running", "stalled", "succeeded", "failed", "cancelled"]
JOB_STATES: tuple[JobState, ...] = get_args(JobState)
TERMINAL: frozenset[JobState] = frozenset({"succeeded", "failed", "cancelled"})
UNFINISHED: tuple[JobState, ...] = ("queued", "placing", "running", "stalled")

_JOB_PROTO: dict[JobState, cpb.JobState] = {
    "queued": cpb.JOB_STATE_QUEUED,
    "placing": cpb.JOB_STATE_PLACING,
    "running": cpb.JOB_STATE_RUNNING,
    "stalled": cpb.JOB_STATE_STALLED,
    "succeeded": cpb.JOB_STATE_SUCCEEDED,
    "failed": cpb.JOB_STATE_FAILED,
    "cancelled": cpb.JOB_STATE_CANCELLED,
}
TERMINAL_PROTO: frozenset[cpb.JobState] = frozenset(_JOB_PROTO[s] for s in TERMINAL)


def job_state_proto(state: JobState) -> cpb.JobState:
    """`JOB_STATE_RUNNING` for "running"."""
    return _JOB_PROTO[state]


def job_state_name(value: int) -> str:
    """The lower-case name of any JobState value, for display: "unspecified" included."""
    return _enum_name(cpb.JobState, value, "JOB_STATE_")


def peer_state_name(value: int) -> str:
    """The lower-case name of a PeerState value: "serving" for `PEER_STATE_SERVING`."""
    return _enum_name(cpb.PeerState, value, "PEER_STATE_")


def _enum_name(enum: EnumTypeWrapper, value: int, prefix: str) -> str:
    return enum.Name(value).removeprefix(prefix).lower()  # type: ignore[arg-type]


# Allowed moves besides "failed"/"cancelled" (reachable from any unfinished state) and staying put.
# running -> placing: a training attempt failed and the job waits to be placed again.
# running <-> stalled: a stage has no replica while the job trains, and is served again.
_NEXT: dict[JobState, frozenset[JobState]] = {
    "queued": frozenset({"placing"}),
    "placing": frozenset({"running"}),
    "running": frozenset({"placing", "stalled", "succeeded"}),
    "stalled": frozenset({"running", "placing", "succeeded"}),
}


def moves(old: JobState, new: JobState) -> list[JobState] | None:
    """The states a job at `old` passes through to `new`, `new` last ([] where it is there);
    None where none lead there (a finished job, say)."""
    paths: dict[JobState, list[JobState]] = {old: []}
    frontier = [old]
    while frontier and new not in paths:
        at = frontier.pop(0)
        for then in sorted(_NEXT.get(at, ())) + (
            ["failed", "cancelled"] if at not in TERMINAL else []
        ):
            if then not in paths:
                paths[then] = [*paths[at], then]
                frontier.append(then)
    return paths.get(new)


def may_move(old: JobState, new: JobState) -> bool:
    """Whether a job at `old` may be set to `new` (as its store refuses otherwise)."""
    if old in TERMINAL:
        return False
    return new == old or new in ("failed", "cancelled") or new in _NEXT[old]
