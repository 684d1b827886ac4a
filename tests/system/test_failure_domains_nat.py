"""Two homes behind real routers (issue 51, item 5): four stage servers, two machines at each
home, all behind NAT and relayed by a relay on the public host; a two-stage job with
`min_replicas = 2`. Placement spreads each stage's two replicas over the two homes (the public
addresses their relay saw), so one home's router going down leaves every stage served. Blind to
routers it put one home on each stage (a, c and b, d: the peers measure alike)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from swarm.local import netns
from tests.support import namespaces
from tests.support.jobs import write_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "swfd-"
HUB = "10.87.0.10"  # the scheduler, its broker and the relay
HOME1 = netns.Lan(
    "gw1", "10.87.0.2", "192.168.87.0/24", {"a": "192.168.87.10", "c": "192.168.87.11"}
)
HOME2 = netns.Lan(
    "gw2", "10.87.0.3", "192.168.88.0/24", {"b": "192.168.88.10", "d": "192.168.88.11"}
)
BROKER = f"mqtt://{HUB}:1883"
SCHEDULER = f"{HUB}:7700"
TOKEN = "failure-domains-token"
HOMES = {"a": HOME1, "c": HOME1, "b": HOME2, "d": HOME2}


@pytest.fixture
def lab() -> Iterator[netns.Network]:
    with namespaces.network(PREFIX, {"hub": HUB}, [HOME1, HOME2]) as net:
        yield net


def _env(work: Path, host: str) -> dict[str, str]:
    # One cache for all: the peers measure one at a time and agree exactly (one machine really);
    # each says it is a machine of its own (namespaces share the machine id and hostname).
    return namespaces.swarm_env(
        TOKEN, work / "cache", SWARM_HOST_ID=f"machine-{host}", SWARM_SCHEDULER=SCHEDULER
    )


def _swarm(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarm.cli", "--log-level", "INFO", *args]


def _on_hub(lab: netns.Network, work: Path, *args: str) -> str:
    """`swarm ARGS` run on the public host; its stdout."""
    return namespaces.run_on(lab, "hub", _swarm(*args), _env(work, "client"))


def _serving(status: dict[str, Any]) -> list[list[str]]:
    """Each stage's serving replicas, by peer."""
    return [
        sorted(r["peer"] for r in s.get("replicas", []) if r.get("state") == "PEER_STATE_SERVING")
        for s in status.get("stages", [])
    ]


def test_a_stages_replicas_sit_behind_two_routers(lab: netns.Network, tmp_path: Path) -> None:
    job = write_job(
        tmp_path,
        training={"stages": 2, "steps": 100_000, "checkpoint_every": 0},
        runtime={"min_replicas": 2},
    )
    procs: list[netns.Proc] = []

    def start(host: str, name: str, *args: str) -> netns.Proc:
        proc = lab.start(host, name, _swarm(*args), tmp_path, _env(tmp_path, name), ROOT)
        procs.append(proc)
        return proc

    stages: list[list[str]] = []
    status: dict[str, Any] = {}
    looker: namespaces.Looker | None = None
    try:
        (tmp_path / "data").mkdir()  # the job's data is synthetic: none there
        scheduler = start(
            "hub",
            "scheduler",
            *("scheduler", "--host", "0.0.0.0", "--announce-host", HUB, "--port", "7700"),
            *("--broker-port", "1883", "--store", str(tmp_path / "jobs.sqlite")),
            *("--checkpoint-dir", str(tmp_path / "ckpt"), "--data-root", str(tmp_path / "data")),
        )
        deadline = time.monotonic() + 200
        scheduler.wait_ready(deadline)
        relay = start(
            "hub",
            "relay",
            *("relay", "--broker", BROKER, "--host", "0.0.0.0", "--port", "7100"),
            *("--announce-host", HUB),
        )
        relay.wait_ready(deadline)
        homes = [
            start(
                peer,
                peer,
                *("stage-server", "--broker", BROKER, "--host", "0.0.0.0", "--port", "7000"),
                *("--announce-host", lan.hosts[peer], "--peer", peer, "--behind-nat"),
                *("--threads", "1"),
            )
            for peer, lan in HOMES.items()
        ]
        for home in homes:
            home.wait_ready(deadline)
        while time.monotonic() < deadline and not all(
            "attached to relay" in home.log() for home in homes
        ):
            time.sleep(0.2)
        job_id = _on_hub(lab, tmp_path, "submit", str(job)).split()[0]
        looker = namespaces.Looker(lab, "hub", SCHEDULER, _env(tmp_path, "client"))
        while time.monotonic() < deadline:
            status = looker.look(job_id)
            stages = _serving(status)
            if [len(s) for s in stages] == [2, 2]:
                break
            time.sleep(0.5)
    finally:
        if looker is not None:
            looker.close()
        for proc in reversed(procs):
            proc.kill()
    logs = {p.name: p.log()[-2000:] for p in procs}
    assert [len(s) for s in stages] == [2, 2], (status, logs)
    # One replica of each stage at each home: either router may go down.
    assert all({HOMES[p].router for p in s} == {"gw1", "gw2"} for s in stages), stages
    assert not any("router" in w for w in status.get("warnings", [])), status["warnings"]
