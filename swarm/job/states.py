"""Job and peer states: the names the store, the CLI and the metrics use, and their protobuf enums
(`control.proto`), converted both ways here and nowhere else."""

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
