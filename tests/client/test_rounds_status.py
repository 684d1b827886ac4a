"""`swarm status` of a job whose pools meet in rounds: one line with the rule, the round, the steps
to the next average and the last average's time and bytes; none for a job without rounds."""

from __future__ import annotations

from client.live import status_lines
from swarm.proto import control_pb2 as cpb
from swarm.proto import scheduler_pb2 as spb


def _job(**rounds: object) -> spb.JobStatus:
    s = spb.JobStatus(job="j", name="diloco", state=cpb.JOB_STATE_RUNNING, step=37, steps=160)
    if rounds:
        s.rounds.CopyFrom(spb.RoundStatus(**rounds))  # type: ignore[arg-type]
    return s


def _rounds(s: spb.JobStatus, now: float = 1000.0) -> list[str]:
    return [line for line in status_lines(s, now=now) if line.startswith("rounds")]


def test_status_shows_the_rounds_of_a_local_steps_job() -> None:
    shape = {"rule": "local", "round": 3, "rounds": 10, "round_steps": 16}
    assert _rounds(_job(**shape, next_average_in=11)) == [
        "rounds   local, round 3/10 (16 steps each), next average in 11 steps; no average yet"
    ]
    averaged = _job(
        **shape, next_average_in=1, last_seconds=0.84, last_at=988.0, last_bytes=3 * (1 << 20) // 2
    )
    assert _rounds(averaged) == [
        "rounds   local, round 3/10 (16 steps each), next average in 1 step; last average "
        "took 840ms, 12s ago, 1.5 MiB moved"
    ]
    done = _job(**{**shape, "round": 10}, last_seconds=75.0, last_at=400.0, last_bytes=900)
    assert _rounds(done) == [
        "rounds   local, round 10/10 (16 steps each), no average left; last average took "
        "1m15s, 10m00s ago, 900 B moved"
    ]
    slow = _job(**shape, next_average_in=16, last_seconds=2.25, last_at=999.0, last_bytes=3 << 30)
    assert _rounds(slow)[0].endswith("last average took 2.2s, 1s ago, 3.0 GiB moved")
    eager = _job(rule="step-eager", round=38, rounds=160, round_steps=1, next_average_in=1)
    assert _rounds(eager) == [
        "rounds   step-eager, round 38/160 (1 step each), next average in 1 step; no average yet"
    ]
    assert _rounds(_job()) == []  # a job without rounds: no line
