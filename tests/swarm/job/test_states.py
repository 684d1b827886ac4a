"""Job and peer state names and their protobuf enums convert both ways, for every state."""

from __future__ import annotations

from swarm.job.states import (
    JOB_STATES,
    TERMINAL,
    TERMINAL_PROTO,
    UNFINISHED,
    job_state_name,
    job_state_proto,
    peer_state_name,
)
from swarm.proto import control_pb2 as cpb


def test_every_job_state_round_trips() -> None:
    assert set(JOB_STATES) == TERMINAL | set(UNFINISHED) and not TERMINAL & set(UNFINISHED)
    protos = {job_state_proto(s) for s in JOB_STATES}
    # Every enum value but UNSPECIFIED has exactly one name.
    assert protos == set(cpb.JobState.values()) - {cpb.JOB_STATE_UNSPECIFIED}
    for state in JOB_STATES:
        assert job_state_name(job_state_proto(state)) == state
    assert job_state_proto("running") == cpb.JOB_STATE_RUNNING
    assert {
        cpb.JOB_STATE_SUCCEEDED,
        cpb.JOB_STATE_FAILED,
        cpb.JOB_STATE_CANCELLED,
    } == TERMINAL_PROTO


def test_peer_state_names() -> None:
    assert peer_state_name(cpb.PEER_STATE_SERVING) == "serving"
    assert [peer_state_name(v) for v in cpb.PeerState.values()] == [
        "unspecified",
        "joining",
        "serving",
        "draining",
        "offline",
        "standby",  # the scheduler's word for a standby (issue 67), never announced
    ]
