"""Issue 69, item 3: the audits' default follows the trust mode. A scheduler open to other
peers (the default) stores a job as submitted, audits on at its default; one started with
`--trusted-peers` writes `audit_fraction = 0.0` into a job that does not set it, and its status
says so; a job that sets it is kept as it said. The job API on a real gRPC server over a real
store (`tests.support.api`)."""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

import pytest

from client.sdk import SchedulerClient
from scheduler import trusted_peers
from scheduler.cli import add_arguments
from scheduler.trusted_peers import AUDITS_OFF, TrustMode, audits_off, trusted
from swarm.job.config import parse_job
from swarm.job.trust import TrustConfig
from swarm.proto.scheduler_pb2 import JobStatus
from tests.support.api import start_api
from tests.support.jobs import BASE, render

# The test jobs' base, less its `audit_fraction` (tests.support.jobs sets 0): the default's
SILENT = {k: v for k, v in BASE.items() if k != "trust"}


def _written(tmp_path: Path, name: str, **sections: dict[str, object]) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(render({**SILENT, **sections}, name))
    return path


def _fraction(spec: str, tmp_path: Path) -> float:
    return parse_job(spec, tmp_path, check_data=False).trust.audit_fraction


def test_a_trusted_spec_audits_nothing_unless_it_says_so(tmp_path: Path) -> None:
    assert _fraction(trusted(render(SILENT)), tmp_path) == 0.0
    with_table = render({**SILENT, "trust": {"norm_bound": 4.0}})  # another key of [trust]
    assert _fraction(trusted(with_table), tmp_path) == 0.0
    assert "norm_bound = 4.0" in trusted(with_table)
    asked = render({**SILENT, "trust": {"audit_fraction": 0.5}})
    assert trusted(asked) == asked  # the job's own word, kept


async def test_an_open_scheduler_keeps_the_default_audits(tmp_path: Path) -> None:
    api = await start_api(tmp_path)
    try:
        async with SchedulerClient(api.address, timeout_s=5.0) as c:
            job = await c.submit(_written(tmp_path, "open"))
        assert _fraction(job.spec, tmp_path) == TrustConfig().audit_fraction > 0
        assert AUDITS_OFF not in job.warnings
    finally:
        await api.stop()


async def test_a_trusting_scheduler_turns_audits_off_and_says_so(tmp_path: Path) -> None:
    api = await start_api(tmp_path, trusted_peers=True)
    try:
        async with SchedulerClient(api.address, timeout_s=5.0) as c:
            default = await c.submit(_written(tmp_path, "trusting"))
            asked = await c.submit(_written(tmp_path, "asked", trust={"audit_fraction": 0.25}))
            shown = await c.get(default.job)
        stored = api.store.get(default.job)
        assert stored is not None and _fraction(stored.spec, tmp_path) == 0.0
        assert AUDITS_OFF in shown.warnings  # never silently
        assert _fraction(asked.spec, tmp_path) == 0.25  # respected
        assert AUDITS_OFF not in asked.warnings
    finally:
        await api.stop()


def test_the_scheduler_says_it_trusts_its_peers_with_one_switch() -> None:
    parser = argparse.ArgumentParser()
    add_arguments("scheduler", parser)
    assert parser.parse_args(["--trusted-peers"]).trusted_peers
    assert not parser.parse_args([]).trusted_peers  # secure by default


async def test_a_stored_spec_is_parsed_once_off_the_loop_for_the_statuses_that_show_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each GetJob parsed the job's spec on the event loop to say "audits off": 0.2 s for a spec
    # of 1 MiB, at every call, and GetJob is not rated. Then once, but on the loop still: a
    # submission's answer, and every status after a restart (a review found it).
    parsed: list[str] = []
    on = threading.get_ident()

    def counted(spec: str) -> bool:
        assert threading.get_ident() != on, "parsed on the event loop"
        parsed.append(spec)
        return audits_off(spec)

    monkeypatch.setattr(trusted_peers, "audits_off", counted)
    mode, spec = TrustMode(True), trusted(render(BASE))
    for _ in range(3):
        assert AUDITS_OFF in (await mode.shown(JobStatus(spec=spec))).warnings
    assert parsed == [spec]
    for i in range(trusted_peers.KEPT_SPECS + 1):  # a bounded memory of them
        await mode.shown(JobStatus(spec=f"{spec}\n# {i}\n"))
    await mode.shown(JobStatus(spec=spec))
    assert len(parsed) == trusted_peers.KEPT_SPECS + 3  # the first was forgotten: read again
