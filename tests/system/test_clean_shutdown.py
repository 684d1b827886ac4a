"""A clean shutdown says nothing alarming, with real processes: a scheduler (with a peer joined,
and a client connected to its broker that has not logged in yet), a peer and a stage server of
its own, each stopped by SIGTERM, exit 0 with no `ERROR` line and no traceback. Before, the
scheduler's embedded broker logged `ERROR asyncio: Exception in callback ...` with a
CancelledError traceback for each connection still opening when it stopped."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from swarm.local.procs import start_process
from tests.support.cli import ROOT

JOB = str(ROOT / "examples" / "tiny_synthetic.toml")
ALARMING = re.compile(r"\bERROR\b|Traceback|never retrieved|was destroyed")


@pytest.mark.slow
def test_sigterm_stops_each_process_without_an_error_line(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    env = {"SWARM_CACHE_DIR": str(tmp_path / "cache")}
    flags = ["--data-root", str(tmp_path / "data"), "--store", str(tmp_path / "jobs.sqlite")]
    flags += ["--checkpoint-dir", str(tmp_path / "checkpoints")]
    scheduler = start_process(
        ["scheduler", *flags, "--port", "0", "--metrics-port", "0"],
        log_dir=tmp_path,
        name="scheduler",
        env=env,
    )
    processes = [scheduler]
    try:
        broker = scheduler.wait_ready(120)["broker"]
        peer = start_process(
            ["stage-server", "--broker", broker, "--peer", "p1", "--metrics-port", "0"],
            log_dir=tmp_path,
            name="peer",
            env=env,
        )
        alone = start_process(
            ["stage-server", "--job", JOB, "--stage", "0", "--metrics-port", "0"],
            log_dir=tmp_path,
            name="alone",
            env=env,
        )
        processes += [peer, alone]
        peer.wait_ready(120)
        alone.wait_ready(120)
        host, port = broker.removeprefix("mqtt://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as opening:  # no CONNECT yet
            opening.sendall(bytes([0x10, 40, 0, 4]) + b"MQTT")
            codes = {p.log_path.name: p.stop() for p in (alone, peer, scheduler)}
    finally:
        for p in processes:
            p.kill()
    assert codes == {"alone.log": 0, "peer.log": 0, "scheduler.log": 0}, codes
    for p in processes:
        alarming = [line for line in p.log().splitlines() if ALARMING.search(line)]
        assert not alarming, f"{p.log_path.name}:\n{p.log()[-3000:]}"
