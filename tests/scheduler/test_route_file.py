"""A job's route record on a full disk (`scheduler.route_file`): the write the disk refuses ends
the record, not the job. It raised out of the step's commit: every attempt after it failed at
its first record, and the job failed, while a checkpoint on the same disk was skipped and
training went on. The record, a gap in it being a wrong replay, is set aside as incomplete, said
at ERROR, and no later attempt, nor a restarted scheduler, records more of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scheduler.route_file import RouteFile, incomplete_path
from scheduler.service import Scheduler, SchedulerOptions
from scheduler.store import JobStore
from swarm.job.rule import RuleKind
from swarm.model.routes import Join, StepRuns, from_json
from tests.support.disks import fill, tiny_disk
from tests.support.fakes import SilentBus
from tests.support.jobs import make_job, with_rule


def test_a_write_the_full_disk_refuses_ends_the_record_not_the_job(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with tiny_disk(tmp_path / "disk") as disk:
        path = disk / "job" / "routes.jsonl"
        routes = RouteFile(path, "job")
        routes(Join(0, 0, "a", None))
        fill(disk)
        for step in range(200):  # past what the file's buffer holds: a write reaches the disk
            routes(StepRuns(step, ()))  # never raises
        assert not routes.open and not path.exists()
        kept = incomplete_path(path).read_text().splitlines()  # its last line may be torn
        assert from_json(json.loads(kept[0])) == Join(0, 0, "a", None)
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1 and "its route record ended" in errors[0], errors
        assert "training goes on" in errors[0] and "No space left" in errors[0]


def test_no_attempt_after_records_more_of_an_ended_record(tmp_path: Path) -> None:
    job = make_job(tmp_path, **with_rule(RuleKind.LOCAL))
    with JobStore(tmp_path / "jobs.db") as store:
        scheduler = Scheduler(store, SilentBus(), SchedulerOptions(tmp_path / "ckpt"))  # type: ignore[arg-type]
        routes = scheduler._training._open_routes("j", job)
        assert routes is not None and routes.open
        routes.close()
        path = scheduler.routes("j")
        path.rename(incomplete_path(path))  # a write ended it
        assert scheduler._training._open_routes("j", job) is None
        assert not path.exists()
