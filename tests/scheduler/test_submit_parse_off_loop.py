"""A submitted spec is parsed off the scheduler's event loop: a 1 MiB spec (the bound) with a
500,000-element array under an unknown key took 3.7 s to parse on a 2-core host before its
refusal, and any swarm-token holder may submit 30 a minute; every other call of the scheduler,
and the embedded broker, waited meanwhile. A real job API over gRPC."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import scheduler.job_api
from client.sdk import SchedulerClient
from swarm.job.config import JobConfig, parse_job
from tests.support.api import start_api
from tests.support.jobs import write_job

pytestmark = pytest.mark.timeout(60)


async def test_a_submitted_spec_is_parsed_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[threading.Thread] = []

    def watched(*args: object, **kwargs: object) -> JobConfig:
        threads.append(threading.current_thread())
        return parse_job(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(scheduler.job_api, "parse_job", watched)  # a spy: the real parse runs
    api = await start_api(tmp_path)
    try:
        async with SchedulerClient(api.address, timeout_s=30.0) as client:
            assert (await client.submit(write_job(tmp_path, "j"))).job
    finally:
        await api.stop()
    assert threads and threading.main_thread() not in threads, threads
