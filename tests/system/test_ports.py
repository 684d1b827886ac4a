"""A port already taken, with real processes: each command that listens says so in one line that
names the port, the flag that moves it and its variable, and exits at once (no traceback, no
wait). The bind sites themselves: tests/swarm/net/test_ports.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarm.local.procs import start_process
from tests.support.cli import ROOT, swarm
from tests.support.ports import free_port, taken_port

JOB = str(ROOT / "examples" / "tiny_synthetic.toml")
BOUND_S = 15.0  # a Python start on a busy machine, not a connect timeout (30 s before)


@pytest.fixture
def taken() -> Iterator[int]:
    """A port another process listens on."""
    with taken_port() as port:
        yield port


def _scheduler(tmp_path: Path, *flags: str) -> list[str]:
    (tmp_path / "data").mkdir(exist_ok=True)
    store = str(tmp_path / "jobs.sqlite")
    kept = ["--store", store, "--checkpoint-dir", str(tmp_path / "checkpoints")]
    return ["scheduler", "--data-root", str(tmp_path / "data"), *kept, *flags]


CASES = {
    "scheduler --port": (_scheduler, "--port", "SWARM_SCHEDULER_PORT", ()),
    "scheduler --metrics-port": (
        _scheduler,
        "--metrics-port",
        "SWARM_SCHEDULER_METRICS_PORT",
        ("--port", "0"),
    ),
    "scheduler --broker-port": (_scheduler, "--broker-port", "SWARM_BROKER_PORT", ("--port", "0")),
    "stage-server --port": (
        lambda _, *f: ["stage-server", "--job", JOB, "--stage", "0", *f],
        "--port",
        "SWARM_STAGE_SERVER_PORT",
        (),
    ),
    "stage-server --metrics-port": (
        lambda _, *f: ["stage-server", "--job", JOB, "--stage", "0", *f],
        "--metrics-port",
        "SWARM_STAGE_SERVER_METRICS_PORT",
        (),
    ),
    "trainer --metrics-port": (
        lambda _, *f: ["trainer", "--job", JOB, "--stage-servers", "127.0.0.1:1", *f],
        "--metrics-port",
        "SWARM_TRAINER_METRICS_PORT",
        (),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_taken_port_is_one_line_naming_its_flag(case: str, taken: int, tmp_path: Path) -> None:
    command, flag, env, others = CASES[case]
    args = command(tmp_path, *others, flag, str(taken))
    started = time.monotonic()
    result = swarm(*args, timeout=60, check=False)
    took = time.monotonic() - started
    role = args[0]
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"swarm {role}: error: port {taken} is taken"), lines[0]
    assert f"give {flag} another port, or 0 for any free one ({env})" in lines[0], lines[0]
    assert took < BOUND_S, f"{took:.1f} s"


@pytest.mark.slow
def test_two_flags_given_one_port_name_the_second(tmp_path: Path) -> None:
    # Free when checked, taken by the job API a moment later: the bind itself says so.
    port = str(free_port())
    result = swarm(*_scheduler(tmp_path, "--port", port, "--metrics-port", port), check=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"port {port} is taken" in lines[0], lines[0]
    assert "give --metrics-port another port" in lines[0], lines[0]
    assert "(SWARM_SCHEDULER_METRICS_PORT)" in lines[0], lines[0]


@pytest.mark.slow
def test_a_peer_given_the_schedulers_job_api_as_its_broker_is_told_at_once(tmp_path: Path) -> None:
    # Before: paho's "Unrecognised command 0", then 30 s of "does not answer".
    scheduler = start_process(_scheduler(tmp_path, "--port", "0"), log_dir=tmp_path)
    try:
        url = f"mqtt://{scheduler.wait_ready(120)['address']}"
        started = time.monotonic()
        env = {"SWARM_CACHE_DIR": str(tmp_path / "cache")}
        peer = swarm("stage-server", "--broker", url, timeout=60, check=False, env=env)
        took = time.monotonic() - started
    finally:
        scheduler.stop()
    assert peer.returncode == 2, peer.stderr
    last = peer.stderr.strip().splitlines()[-1]
    assert last.startswith("swarm stage-server: error: bus peer-"), peer.stderr
    assert f"{url} answered but is not an MQTT broker (it looks like a gRPC/HTTP2 server" in last
    assert "point --broker at the broker's port (the scheduler printed it at start)" in last
    assert "Unrecognised command" not in peer.stderr and "Traceback" not in peer.stderr
    assert took < BOUND_S, f"{took:.1f} s"
