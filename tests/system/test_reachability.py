"""Reachability measured by the scheduler, with real processes (issue 42): a stage server that
announces an address nobody listens on is dialled back, found UNREACHABLE, never assigned, and
`swarm status` says so with the flags that fix it; one that answers is direct, and serves."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from swarm.local.procs import LocalSwarm, start_local_swarm
from tests.support.cli import swarm
from tests.support.jobs import write_job
from tests.support.status import job_status, job_status_text, shown_once
from tests.support.waiting import wait_until_blocking

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def _metrics(sw: LocalSwarm) -> str:
    url = f"http://127.0.0.1:{sw.scheduler.ready['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as answer:
        text: str = answer.read().decode()
    return text


def test_a_peer_nobody_can_dial_is_unreachable_in_status_with_the_remedy_and_not_assigned(
    tmp_path: Path,
) -> None:
    job = write_job(tmp_path, training={"stages": 1, "steps": 100_000})
    sw, _ = start_local_swarm([], log_dir=tmp_path)
    try:
        # It listens on 127.0.0.1 and announces 127.0.0.2: nothing answers there.
        sw.add_peer(extra=["--announce-host", "127.0.0.2"])
        job_id = swarm("submit", str(job), "--scheduler", sw.address).stdout.split()[0]
        shown = shown_once(sw.address, job_id, "UNREACHABLE")
        assert "peer0" in shown and "127.0.0.2:" in shown, shown
        for fix in ("--announce-host", "forward port", "swarm relay", "--relay"):
            assert fix in shown, (fix, shown)
        assert 'swarm_peer_reachability{peer="peer0",reachability="unreachable"} 1.0' in _metrics(
            sw
        )

        # A peer that answers is direct, and serves the job; peer0 is still placed nowhere.
        sw.add_peer()
        wait_until_blocking(
            lambda: "direct" in job_status_text(sw.address, job_id),
            "peer1 serves, reached directly",
            every_s=0.3,
        )
        status = job_status(sw.address, job_id)
        replicas = [r for stage in status["stages"] for r in stage.get("replicas", [])]
        assert [r["peer"] for r in replicas] == ["peer1"], replicas
        assert replicas[0]["reachability"] == "REACHABILITY_DIRECT"
        assert f"job {job_id}: stage 0 -> peer0" not in sw.scheduler.log()
        assert "peer peer0 is unreachable" in sw.scheduler.log()
    finally:
        sw.stop()
