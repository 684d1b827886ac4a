"""A friend behind a home router checks their invite before anything starts (issue 51, item 6): a
public host runs the scheduler (its embedded broker) and a relay; the friend's machine sits on a
private LAN behind a NAT router (`swarm.local.nat`: masquerade, no inbound connection). `swarm
invite alice` on the public host, `swarm doctor --join` on the friend's machine: it logs in to the
broker as alice, calls the scheduler with the token, and says `behind NAT (...) → relayed via`
the relay, the scheduler having seen the router's address, not the friend's; on the public host
the same invite reads `direct`. Before, the doctor only opened two TCP connections and said
nothing of NAT. Needs root and nftables (CI has both)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarm.local import netns
from tests.support import namespaces
from tests.support.cli import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PREFIX = "swi-"
HUB = "10.87.0.10"  # the public host: the scheduler, its broker, a relay
ROUTER = "10.87.0.2"  # the friend's home router, as the public side sees it
LAN = netns.Lan("gw", ROUTER, "192.168.87.0/24", {"home": "192.168.87.10"})
HOME = LAN.hosts["home"]
TOKEN = "invite-nat-token"


@pytest.fixture
def lab() -> Iterator[netns.Network]:
    with namespaces.network(PREFIX, {"hub": HUB}, [LAN]) as net:
        yield net


def _swarm(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarm.cli", *args]


def _run(lab: netns.Network, work: Path, host: str, argv: list[str], **env: str) -> tuple[int, str]:
    done = subprocess.run(
        ["ip", "netns", "exec", lab.ns[host], *argv],
        capture_output=True,
        text=True,
        env=namespaces.host_env(work, host, **env),
        cwd=ROOT,
        timeout=120,
    )
    return done.returncode, done.stdout + done.stderr


def test_doctor_behind_nat_names_the_relay(lab: netns.Network, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    procs: list[netns.Proc] = []

    def start(name: str, *args: str) -> netns.Proc:
        env = namespaces.host_env(tmp_path, name, SWARM_TOKEN=TOKEN)
        procs.append(lab.start("hub", name, _swarm(*args), tmp_path, env, ROOT))
        return procs[-1]

    broker = f"mqtt://{HUB}:1883"
    try:
        scheduler = start(
            "scheduler",
            *("scheduler", "--host", "0.0.0.0", "--announce-host", HUB, "--port", "7700"),
            *("--broker-port", "1883", "--store", str(tmp_path / "jobs.sqlite")),
            *("--checkpoint-dir", str(tmp_path / "ckpt"), "--data-root", str(data)),
        )
        deadline = time.monotonic() + 90
        assert scheduler.wait_ready(deadline)["broker"] == broker
        relay = start(
            "relay",
            *("relay", "--broker", broker, "--host", "0.0.0.0", "--announce-host", HUB),
            *("--port", "7000", "--peer", "relay-vps"),
        )
        relay.wait_ready(deadline)
        out = tmp_path / "alice.invite.json"
        invite = ["invite", "alice", "--broker", broker, "--scheduler", f"{HUB}:7700"]
        rc, said = _run(lab, tmp_path, "hub", _swarm(*invite, "--out", str(out)), SWARM_TOKEN=TOKEN)
        assert rc == 0, said

        rc, said = _run(lab, tmp_path, "home", _swarm("doctor", "--join", str(out)))
        assert rc == 0, said
        assert "accepted the login as alice" in said, said
        assert "answered an authenticated call" in said, said
        assert (
            f"ok   path: behind NAT (this machine is {HOME}; the scheduler sees {ROUTER}, its "
            f"router) → relayed via relay-vps ({HUB}:7000)"
        ) in said, said

        rc, said = _run(lab, tmp_path, "hub", _swarm("doctor", "--join", str(out)))
        assert rc == 0, said
        assert f"ok   path: direct: the scheduler sees this machine as {HUB}" in said, said
    finally:
        for proc in procs:
            proc.kill()
    logs = {p.name: p.log() for p in procs}
    assert not [name for name, text in logs.items() if "Traceback" in text], logs
