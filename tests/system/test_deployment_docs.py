"""docs/deployment.md's Mosquitto part, followed as written: section 2's block (the CA, the
certificates, the token), then the Mosquitto section's blocks, run by bash in a fresh directory;
the real Mosquitto is started as root with the written configuration (it becomes user mosquitto),
and must start without a warning and let in exactly who the doc says. Only the host, the port and
the broker's directory are replaced, each asserted to be there: 127.0.0.1 for broker.example.org,
a free port for 8883, a directory here for /etc/swarm/broker (tests.support.guide)."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from swarm.cli import parse
from swarm.net import tls
from tests.support.brokers import reachable_dir, running
from tests.support.buses import check_logins
from tests.support.guide import bash, bash_env, blocks, checkout, commands, replaced
from tests.support.ports import free_port

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="Mosquitto drops privileges only when root"),
]

SECTION_2 = "## 2. A CA, a certificate per host, and the token"
MOSQUITTO_SECTION = "### Mosquitto instead of the embedded broker"


def test_the_mosquitto_section_works_as_written() -> None:
    with reachable_dir() as work:
        follow_the_doc(work)


def follow_the_doc(work: Path) -> None:
    (setup,) = blocks(SECTION_2)
    issue, start, run = blocks(MOSQUITTO_SECTION)
    port = free_port("127.0.0.1")
    broker_dir = work / "etc-swarm-broker"
    issue = replaced(issue, {"broker.example.org": "127.0.0.1", "8883": str(port)})
    issue = replaced(issue, {"/etc/swarm/broker": str(broker_dir)})
    done = subprocess.run(
        bash(setup + issue),
        cwd=checkout(work),
        env=bash_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "made up" not in done.stdout  # the tokens of the doc's files were used

    # The start line as written, bar the path; the binary is the one tests use.
    ((mosquitto, *flags),) = commands(replaced(start, {"/etc/swarm/broker": str(broker_dir)}))
    assert (mosquitto, flags[:1]) == ("mosquitto", ["-c"])
    token = (work / "token").read_text().strip()
    scheduler_token = (work / "scheduler-token").read_text().strip()
    tls.configure(tls.Tls.load(work / "certs" / "ca.pem", None, None, False))
    try:
        with running(Path(flags[1]), port) as log:
            url = f"mqtts://127.0.0.1:{port}"
            asyncio.run(check_logins(url, "gpu1", token, scheduler_token))
            text = log.read_text()
    finally:
        tls.configure(None)
    assert "Warning" not in text, text
    assert "Error" not in text, text

    # The scheduler's and the stage server's lines parse as `swarm` reads them.
    run_commands = [c for c in commands(run) if c]
    assert [c[0] for c in run_commands] == ["export", "swarm", "swarm"]
    scheduler = parse(run_commands[1][1:])
    stage_server = parse(run_commands[2][1:])
    assert scheduler.broker == stage_server.broker == "mqtts://broker.example.org:8883"
    assert stage_server.peer == "gpu1"
