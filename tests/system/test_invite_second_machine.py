"""A friend's second machine joins on the same invite (issue 68 item 1), as the guide says and a
user runs it: a public host runs the scheduler with TLS (its embedded broker `mqtts://`) and a
relay holding the swarm's CA; `swarm invite alice` there; the friend's two machines sit on one LAN
behind a NAT router (`swarm.local.nat`), and start `swarm stage-server --join alice.invite.json`
and `... --peer gpu1.alice`, no other flag. Both attach to the relay and the scheduler's
dial-back reaches each through it, verifying its certificate for its peer id end to end: the
report "relayed through" is that dial-back's. Before, the relay matched certificate names
exactly and refused `gpu1.alice` forever ("its certificate does not name
gpu1.alice.peer.swarm"), though the invite's certificate carries `*.alice.peer.swarm` and the
stage server's own start check had taken it. Needs root and nftables (CI has both)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarm.local import netns
from swarm.net.certs import init_ca, issue
from tests.support import namespaces

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = namespaces.ROOT
PREFIX = "swj-"
HUB = "10.89.0.10"  # the public host: the scheduler, its broker, the relay
HOME = netns.Lan("gw", "10.89.0.2", "192.168.89.0/24", {"a": "192.168.89.10", "b": "192.168.89.11"})
RELAY_PORT = 7100
TOKEN = "invite-second-machine-token"
_swarm = namespaces.swarm_argv


@pytest.fixture
def lab() -> Iterator[netns.Network]:
    with namespaces.network(PREFIX, {"hub": HUB}, [HOME]) as net:
        yield net


def test_a_second_machine_on_one_invite_is_carried_by_a_tls_relay(
    lab: netns.Network, tmp_path: Path
) -> None:
    certs, data = tmp_path / "certs", tmp_path / "data"
    init_ca(certs)
    issue(certs, "scheduler", [HUB])
    data.mkdir()
    hub_env = namespaces.swarm_env(
        TOKEN,
        tmp_path / "cache-hub",
        SWARM_TLS_CA=str(certs / "ca.pem"),
        SWARM_TLS_CERT=str(certs / "scheduler.pem"),
        SWARM_TLS_KEY=str(certs / "scheduler.key"),
    )
    procs: list[netns.Proc] = []

    def start(host: str, name: str, env: dict[str, str], *args: str) -> netns.Proc:
        procs.append(lab.start(host, name, _swarm(*args), tmp_path, env, ROOT))
        return procs[-1]

    try:
        args = namespaces.scheduler_args(HUB, tmp_path, data)
        scheduler = start("hub", "scheduler", hub_env, *args)
        deadline = time.monotonic() + 240
        broker = scheduler.wait_ready(deadline)["broker"]
        assert broker.startswith("mqtts://"), broker
        relay = ("--host", "0.0.0.0", "--port", str(RELAY_PORT), "--announce-host", HUB)
        start("hub", "relay", hub_env, "relay", "--broker", broker, "--peer", "relay-vps", *relay)
        procs[-1].wait_ready(deadline)
        out = tmp_path / "alice.invite.json"
        where = ("--broker", broker, "--scheduler", f"{HUB}:7700", "--out", str(out))
        namespaces.run_on(
            lab, "hub", _swarm("invite", "alice", "--ca-dir", str(certs), *where), hub_env
        )
        # The friend's machines: the invite and nothing else, each its own cache directory.
        for host, more in (("a", ()), ("b", ("--peer", "gpu1.alice"))):
            env = namespaces.host_env(tmp_path, host)
            start(host, host, env, "stage-server", "--join", str(out), "--device", "cpu", *more)
        for proc in procs[2:]:
            proc.wait_ready(deadline)
        said = {"a": "alice", "b": "gpu1.alice"}
        said = {h: f"{peer}: relayed through {HUB}:{RELAY_PORT}" for h, peer in said.items()}
        home = {p.name: p for p in procs[2:]}
        while time.monotonic() < deadline and not all(
            line in home[h].log() for h, line in said.items()
        ):
            time.sleep(0.2)
    finally:
        for proc in reversed(procs):
            proc.kill()
    logs = {p.name: p.log() for p in procs}
    story = "\n".join(f"{name}:\n{text[-2500:]}" for name, text in logs.items())
    for host, line in said.items():
        assert line in logs[host], story
    assert "does not name" not in logs["b"], logs["b"][-3000:]
    assert not [name for name, text in logs.items() if "Traceback" in text], story
