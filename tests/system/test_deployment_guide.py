"""docs/deployment.md's sections 2 and 3, followed as written on three machines: section 2's block
on the machine that issues, then each machine's block of section 3 (after the block for every
machine) run by bash in its own network namespace with its own address, in a directory of its own
holding only what section 2 says to give it (`certs/ca.pem`, its own certificate and key, the
tokens). The scheduler serves TLS on 0.0.0.0 with its embedded broker, a stage server joins it
from another address, a third submits the job and follows it to its end. Only hosts, paths and
the device are replaced, each asserted to be there (`tests.support.guide`); the job the guide
names is made tiny by replacing its keys, each asserted too. Then Prometheus's view: /metrics
takes the metrics token section 3 started every process with, and refuses the swarm token.
Needs root (CI runs as root); everything it makes is removed."""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarm.local import netns
from tests.support import namespaces
from tests.support.guide import bash, bash_env, blocks, checkout, examples, machine, replaced

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SECTION_2 = "## 2. A CA, a certificate per host, and the token"
SECTION_3 = "## 3. Start everything with TLS and the token"
PREFIX = "swg-"
# host -> (its name in the guide, its certificate's name, its address here)
MACHINES = {
    "sched": ("sched.example.org", "scheduler", "10.79.0.10"),
    "gpu1": ("203.0.113.7", "gpu1", "10.79.0.11"),
    "alice": ("198.51.100.4", "alice-laptop", "10.79.0.12"),
}
ADDRESS = {host: address for host, (_, _, address) in MACHINES.items()}
# The job the guide names, made small enough to train in seconds on one stage server's CPU.
TINY = {
    "stages = 4": "stages = 1",
    "steps = 300": "steps = 4",
    'precision = "bf16-mixed"': 'precision = "fp32"',
    "warmup_steps = 30": "warmup_steps = 1",
}


@pytest.fixture
def network() -> Iterator[netns.Network]:
    with namespaces.network(PREFIX, ADDRESS) as net:
        yield net


def _machine(work: Path, issuer: Path, host: str) -> Path:
    """`host`'s checkout, given what section 2 says to give it (and no other key)."""
    home = machine(work / host, issuer, MACHINES[host][1])
    examples(home, TINY)
    return home


@pytest.mark.parametrize("layout", ["three machines", "one machine"])
def test_sections_2_and_3_work_as_written(
    network: netns.Network, tmp_path: Path, layout: str
) -> None:
    """Three machines: each in its namespace, at its address. One machine: every block in one
    namespace, in the directory section 2 ran in, every host named 127.0.0.1 (as the guide says
    for one machine)."""
    one = layout == "one machine"
    address = {h: "127.0.0.1" if one else a for h, a in ADDRESS.items()}

    def names(text: str, *hosts: str) -> str:
        """The guide's name of each of `hosts` (each must be in `text`) made its address here."""
        return replaced(text, {MACHINES[host][0]: address[host] for host in hosts})

    (setup,) = blocks(SECTION_2)
    every, on_scheduler, on_gpu1, on_alice = blocks(SECTION_3)[:4]
    data_root = {"/srv/swarm-data": str(tmp_path / "srv-swarm-data")}  # one path on each machine
    issuer = checkout(tmp_path / "issuer")
    done = subprocess.run(
        bash(names(setup, *MACHINES)),
        cwd=issuer,
        env=bash_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    if one:
        examples(issuer, TINY)
    homes = {host: issuer if one else _machine(tmp_path, issuer, host) for host in MACHINES}
    scripts = {
        "sched": every + replaced(names(on_scheduler, "sched"), data_root),
        "gpu1": every
        + replaced(names(on_gpu1, "sched", "gpu1"), {"--device cuda:0": "--device cpu"}),
        "alice": every + replaced(names(on_alice, "sched"), data_root),
    }
    procs: list[netns.Proc] = []

    def start(host: str) -> netns.Proc:
        own = bash_env(HOME=str(tmp_path / f"home-{host}"))  # a cache directory of its own
        where = "sched" if one else host
        procs.append(network.start(where, host, bash(scripts[host]), tmp_path, own, homes[host]))
        return procs[-1]

    sched = address["sched"]
    try:
        deadline = time.monotonic() + 60
        ready = start("sched").wait_ready(deadline)
        # Bound to every interface, it announces the guide's name for it, with its broker's port.
        assert ready["address"] == f"{sched}:7700", ready
        assert ready["broker"] == f"mqtts://{sched}:8883", ready
        ready = start("gpu1").wait_ready(deadline)
        assert ready["address"].startswith(f"{address['gpu1']}:"), ready
        submit = start("alice")
        submit.popen.wait(120)
        logs = "".join(f"\n--- {p.name}:\n{p.log()[-3000:]}" for p in procs)
        assert submit.popen.returncode == 0, logs
        assert "succeeded" in submit.log(), logs

        # Prometheus (here from alice's machine, with its certificate) scrapes with the metrics
        # token the processes started with; the swarm token, which lets a caller into the RPCs,
        # is refused.
        scrape = functools.partial(_scrape, network.ns["sched" if one else "alice"], homes["alice"])
        assert scrape(f"{sched}:9100", "metrics-token") == 200
        assert scrape(f"{address['gpu1']}:9101", "metrics-token") == 200
        assert scrape(f"{sched}:9100", "token") == 401
    finally:
        for proc in procs:
            proc.kill()
    logs = {p.name: p.log() for p in procs}
    assert not [name for name, text in logs.items() if "Traceback" in text], logs


SCRAPE = """
import ssl, sys, urllib.error, urllib.request
context = ssl.create_default_context(cafile="certs/ca.pem")
context.load_cert_chain("certs/alice-laptop.pem", "certs/alice-laptop.key")
token = open(sys.argv[2]).read().strip()
request = urllib.request.Request(sys.argv[1], headers={"Authorization": f"Bearer {token}"})
try:
    print(urllib.request.urlopen(request, context=context, timeout=10).status)
except urllib.error.HTTPError as e:
    print(e.code)
"""


def _scrape(ns: str, home: Path, where: str, token_file: str) -> int:
    """The HTTP status of GET https://`where`/metrics from alice's machine with `token_file`."""
    argv = [sys.executable, "-c", SCRAPE, f"https://{where}/metrics", token_file]
    done = subprocess.run(
        ["ip", "netns", "exec", ns, *argv],
        cwd=home,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())
