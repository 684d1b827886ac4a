"""`scheduler.parsed_jobs`: a stored job's spec parsed once for its fetches, however many ask at
once (FetchData and FetchInit parsed it at every call, ~0.8 s of the thread pool's time for a
1 MiB spec: twenty calls kept open kept the pool busy; a review found it), kept by its spec's
digest, its failures not kept, the last `most` asked kept."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from scheduler.parsed_jobs import ParsedJobs, parse_stored
from scheduler.store import JobStore
from scheduler.store_rows import JobRecord
from swarm.errors import ConfigError
from swarm.job.config import JobConfig
from tests.support.jobs import BASE, render


class _Counted:
    """The real parser, its calls counted, each held until `go` is set."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.go = threading.Event()

    def __call__(self, record: JobRecord) -> JobConfig:
        self.calls.append(record.id)
        assert self.go.wait(10)
        return parse_stored(record)


def _records(tmp_path: Path, count: int) -> list[JobRecord]:
    with JobStore(tmp_path / "jobs.db") as store:
        return [store.create(f"j{n}", render(BASE), "/", 3) for n in range(count)]


async def test_callers_at_once_share_one_parse(tmp_path: Path) -> None:
    (record,) = _records(tmp_path, 1)
    parse = _Counted()
    jobs = ParsedJobs(parse)
    asking = [asyncio.create_task(jobs.get(record)) for _ in range(20)]
    await asyncio.sleep(0.05)
    parse.go.set()
    configs = await asyncio.gather(*asking)
    assert parse.calls == [record.id]
    assert all(c is configs[0] for c in configs)
    assert await jobs.get(record) is configs[0] and parse.calls == [record.id]


async def test_another_spec_under_the_id_a_failure_and_the_oldest_are_parsed_again(
    tmp_path: Path,
) -> None:
    first, second, third = _records(tmp_path, 3)
    parse = _Counted()
    parse.go.set()
    jobs = ParsedJobs(parse, most=2)
    await jobs.get(first)
    changed = replace(first, spec=render(BASE) + "# another job under the same id\n")
    await jobs.get(changed)
    assert parse.calls == [first.id, first.id]
    broken = replace(second, spec="this is not TOML = = =")
    for _ in range(2):
        with pytest.raises(ConfigError):
            await jobs.get(broken)
    assert parse.calls[2:] == [second.id, second.id]  # not kept: parsed again
    await jobs.get(second)
    await jobs.get(third)  # two kept: `changed` (the least recently asked) is forgotten
    await jobs.get(changed)
    assert parse.calls[4:] == [second.id, third.id, first.id]
