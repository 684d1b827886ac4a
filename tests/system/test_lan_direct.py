"""Peers behind one home router reach each other directly (issue 51, item 7), for real: a public
host runs the scheduler (embedded broker and trainer) and a `swarm relay`; two stage servers sit
on one private LAN behind one NAT router (`swarm.local.nat`), each announcing its LAN address as
an operator at home would, so both are relayed; a 2-stage job on the push data plane, so stage
0's replica sends to stage 1's itself.

The trainer reaches stage 0 through the relay (nothing else can reach it), but the hop from
stage 0 to stage 1 goes straight over the LAN, every push but the first: what stage 1's host
takes from the relay during the job is bounded by the control calls plus one push, and what it
takes from stage 0's LAN address, on its gRPC port, is at least every other push (nftables
counters in its namespace count both; the relay's bytes by connection, the job's alone: the
relay's pings on the host's attachment, made before, grow with the minutes). Before, every call
to a relayed peer went through the relay, its LAN neighbour's included: nothing arrived from the
neighbour at all. The job still ends float64-equal to `swarm local`. Needs root and nftables (CI
has both).

One microbatch in flight (`max_in_flight = 1`; tests/support/lan_hops.py says why)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarm.local import netns
from tests.support import namespaces
from tests.support.equality import assert_equal_to_local
from tests.support.lan_hops import assert_hops_over_the_lan, write_lan_job
from tests.support.waiting import wait_until_blocking

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ROOT = namespaces.ROOT
PREFIX = "swl-"
HUB = "10.85.0.10"
HOME = netns.Lan("gw", "10.85.0.2", "192.168.85.0/24", {"a": "192.168.85.10", "b": "192.168.85.11"})
SCHEDULER = f"{HUB}:7700"
BROKER = f"mqtt://{HUB}:1883"
RELAY_PORT, PORT = 7100, 7000
TOKEN = "lan-direct-token"


@pytest.fixture
def lab() -> Iterator[netns.Network]:
    with namespaces.network(PREFIX, {"hub": HUB}, [HOME]) as net:
        yield net


def _env(work: Path, name: str) -> dict[str, str]:
    return namespaces.swarm_env(TOKEN, work / f"cache-{name}")


_swarm = namespaces.swarm_argv


def _on_hub(lab: netns.Network, work: Path, *args: str) -> str:
    """A `swarm` client command on the public host; its stdout."""
    return namespaces.run_on(lab, "hub", _swarm(*args), _env(work, "client"))


def _tally(lab: netns.Network, host: str, neighbour: str) -> None:
    """Count, in `host`'s namespace, what arrives at its gRPC port from `neighbour` (the LAN,
    directly) and what arrives from the relay (every tunnel's data connection, which `host`
    opened to the relay's port), in all and by connection (`host`'s end of it)."""
    relay = f"ip saddr {HUB} tcp sport {RELAY_PORT}"
    namespaces.tally(
        lab,
        host,
        {"lan": f"ip saddr {neighbour} tcp dport {PORT}", "relay": relay},
        by_connection={"relayed": relay},
    )


def test_peers_behind_one_router_hop_over_their_lan(lab: netns.Network, tmp_path: Path) -> None:
    job = write_lan_job(tmp_path)
    data_root = tmp_path / "data"
    data_root.mkdir()
    lan = dict(HOME.hosts)
    _tally(lab, "a", lan["b"])
    _tally(lab, "b", lan["a"])
    procs: list[netns.Proc] = []
    looker: namespaces.Looker | None = None

    def start(host: str, name: str, *args: str) -> netns.Proc:
        proc = lab.start(host, name, _swarm(*args), tmp_path, _env(tmp_path, name), ROOT)
        procs.append(proc)
        return proc

    try:
        scheduler = start("hub", "scheduler", *namespaces.scheduler_args(HUB, tmp_path, data_root))
        deadline = time.monotonic() + 240
        assert scheduler.wait_ready(deadline)["broker"] == BROKER
        relay = ("--host", "0.0.0.0", "--port", str(RELAY_PORT), "--announce-host", HUB)
        start("hub", "relay", "relay", "--broker", BROKER, "--peer", "relay0", *relay).wait_ready(
            deadline
        )
        serving = ("--broker", BROKER, "--host", "0.0.0.0", "--port", str(PORT), "--threads", "1")
        for host, address in lan.items():
            start(host, host, "stage-server", *serving, "--announce-host", address, "--peer", host)
        for proc in procs[2:]:
            assert proc.wait_ready(deadline)["address"] == f"{lan[proc.name]}:{PORT}"
        # both behind NAT: each reached through the relay by whoever is elsewhere; the
        # connections open now (each host's attachment) carry nothing of the job
        for proc in procs[2:]:
            said = f"{proc.name} says it is relayed"
            wait_until_blocking(lambda p=proc: "relayed through" in p.log(), said, timeout_s=120)
        opened = {host: namespaces.tallied_by_connection(lab, host, "relayed") for host in lan}
        job_id = _on_hub(lab, tmp_path, "submit", str(job), "--scheduler", SCHEDULER).split()[0]
        state, end = "", time.monotonic() + 300
        looker = namespaces.Looker(lab, "hub", SCHEDULER, _env(tmp_path, "client"))
        while state not in ("JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED") and time.monotonic() < end:
            state = looker.look(job_id)["state"]
            time.sleep(0.2)
        story = "\n".join(f"{p.name}:\n{p.log()[-2000:]}" for p in procs)
        assert state == "JOB_STATE_SUCCEEDED", story
        out = tmp_path / "swarm.pt"
        _on_hub(lab, tmp_path, "export", job_id, "--out", str(out), "--scheduler", SCHEDULER)
        counted = {host: namespaces.tallied(lab, host) for host in lan}
        relayed = {host: namespaces.tallied_by_connection(lab, host, "relayed") for host in lan}
    finally:
        if looker is not None:
            looker.close()
        for proc in reversed(procs):
            proc.kill()
    logs = {p.name: p.log() for p in procs}
    placed = {h: int(m[1]) for h in lan if (m := re.search(r"serving stage (\d+)", logs[h]))}
    assert sorted(placed.values()) == [0, 1], placed  # one replica per stage, one on each host
    last = next(h for h, k in placed.items() if k == 1)
    assert_hops_over_the_lan(counted[last]["lan"], relayed[last], opened[last], counted)
    assert_equal_to_local(job, torch.load(out), tol=1e-9)
