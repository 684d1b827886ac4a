"""`swarm health` (a container's health check) against a real scheduler process: SERVING and exit
0 while it serves; exit 1 with the reason from a port where nothing serves, and from a stopped
scheduler."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from swarm.local.procs import start_process
from tests.support.cli import swarm

pytestmark = pytest.mark.slow


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_health_says_serving_then_nothing_once_the_scheduler_stops(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    args = ["scheduler", "--data-root", str(data), "--port", "0"]
    args += ["--checkpoint-dir", str(tmp_path / "checkpoints")]
    scheduler = start_process([*args, "--store", str(tmp_path / "jobs.sqlite")], log_dir=tmp_path)
    try:
        address = scheduler.wait_ready(120)["address"]
        done = swarm("health", "--health-address", address)
        assert done.stdout.strip() == f"{address}: SERVING"
    finally:
        assert scheduler.stop() == 0
    stopped = swarm("health", "--health-address", address, "--health-timeout", "2", check=False)
    assert stopped.returncode == 1
    assert stopped.stdout.startswith(f"{address}: no answer (UNAVAILABLE"), stopped.stdout


def test_health_from_a_port_where_nothing_serves_fails_with_the_reason() -> None:
    address = f"127.0.0.1:{_closed_port()}"
    done = swarm("health", "--health-address", address, "--health-timeout", "2", check=False)
    assert done.returncode == 1
    assert done.stdout.startswith(f"{address}: no answer (UNAVAILABLE"), done.stdout
