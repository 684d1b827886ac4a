"""`stalled` is a job state like the others: the store moves a training job there and back, the
metrics and `swarm status` name it, and it is no end."""

from __future__ import annotations

import math
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from client.live import status_lines
from scheduler.collector import collector
from scheduler.registry import PeerRegistry
from scheduler.store import JobRecord, JobStore
from swarm.clock import MonotonicClock
from swarm.job.states import TERMINAL, UNFINISHED, job_state_name, job_state_proto
from swarm.proto import control_pb2 as cpb
from swarm.proto import scheduler_pb2 as spb


class _View:
    """What the collector reads of a scheduler (`scheduler.collector.SchedulerView`)."""

    def __init__(self, records: dict[str, JobRecord]) -> None:
        self.peer_registry = PeerRegistry(
            MonotonicClock(), load_silence_s=10.0, serve_timeout_s=60.0
        )
        self.snapshot = records


def test_a_stalled_job_is_unfinished_counted_and_shown(tmp_path: Path) -> None:
    assert "stalled" in UNFINISHED and "stalled" not in TERMINAL
    assert job_state_name(cpb.JOB_STATE_STALLED) == "stalled"
    assert job_state_proto("stalled") == cpb.JOB_STATE_STALLED
    with JobStore(tmp_path / "jobs.db") as store:
        job = store.create("tiny", "spec", "/data", steps=10)
        for state in ("placing", "running"):
            store.set_state(job.id, state)  # type: ignore[arg-type]
        record = store.set_state(job.id, "stalled", message="stalled at step 3: ...")
        assert [r.id for r in store.unfinished()] == [job.id]  # a restart resumes it
        registry = CollectorRegistry()
        registry.register(collector(_View({job.id: record})))
        scraped = generate_latest(registry).decode()
        assert f'swarm_job_state{{job="{job.id}",state="stalled"}} 1.0' in scraped
        assert f'swarm_job_state{{job="{job.id}",state="running"}} 0.0' in scraped
        status = spb.JobStatus(
            job=job.id,
            name="tiny",
            state=job_state_proto(record.state),
            step=3,
            steps=10,
            loss=math.nan,
            message=record.message,
            created=record.created,
            updated=record.updated,
        )
        lines = status_lines(status, now=record.updated)
        assert "state    stalled" in lines  # no "after ...": it has not ended
        assert store.set_state(job.id, "running").state == "running"
