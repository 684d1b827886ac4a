"""Many hosts for real: the broker, the scheduler, four stage servers and a remote trainer each
run in a network namespace of their own with their own address, bind 0.0.0.0 and announce the
namespace's address, with mutual TLS (a certificate per host from the swarm's CA) and the token
on every connection. A peer is killed with SIGKILL mid-job; the job ends float64-equal to
`swarm local`. Needs root (CI runs as root)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarm.local import netns
from swarm.net.certs import init_ca, issue
from tests.support import namespaces
from tests.support.equality import assert_equal_to_local
from tests.support.jobs import write_job

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "swt-"
SUBNET = "10.78.0"
PEERS = [f"peer{i}" for i in range(4)]
HOSTS = ["broker", "scheduler", "trainer", *PEERS]
ADDRESSES = {h: f"{SUBNET}.{10 + i}" for i, h in enumerate(HOSTS)}
TOKEN = "many-hosts-token"
STEPS = 20  # the kill lands at step 3 or later (the job held still), checkpoints at 10 and 20
RUN_S = 0.3
"""While the test looks (the job's status, asked from the trainer's namespace by a `Looker`) the
job holds still: the scheduler runs no trainer of its own and the remote trainer is stopped
(SIGSTOP), so what the test sees is where the job is, and the kill lands mid-job however fast
the machine trains. Between two looks the trainer runs `RUN_S`, a few steps at most (a 30-step
job once ended between two looks of a test that let it run)."""


@pytest.fixture
def network() -> Iterator[netns.Network]:
    with namespaces.network(PREFIX, ADDRESSES) as net:
        yield net


def _env(certs: Path, host: str, work: Path) -> dict[str, str]:
    return namespaces.host_env(work, host) | {
        "SWARM_TOKEN": TOKEN,
        "SWARM_TLS_CA": str(certs / "ca.pem"),
        "SWARM_TLS_CERT": str(certs / f"{host}.pem"),
        "SWARM_TLS_KEY": str(certs / f"{host}.key"),
        "SWARM_TLS_MUTUAL": "1",
    }


def _swarm(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarm.cli", "--log-level", "INFO", *args]


def test_a_swarm_of_hosts_with_tls_trains_exactly_through_a_kill(
    network: netns.Network, tmp_path: Path
) -> None:
    certs = tmp_path / "certs"
    init_ca(certs)
    for host in HOSTS:
        issue(certs, host, [ADDRESSES[host]])
    job = write_job(tmp_path, training={"stages": 2, "steps": STEPS, "checkpoint_every": 10})
    data_root = tmp_path / "data"  # not tmp_path: it holds the store, checkpoints and keys
    data_root.mkdir()
    procs: list[netns.Proc] = []
    looker: namespaces.Looker | None = None

    def start(host: str, *args: str) -> netns.Proc:
        env = _env(certs, host, tmp_path)
        proc = network.start(host, host, _swarm(*args), tmp_path, env, ROOT)
        procs.append(proc)
        return proc

    def client(*args: str) -> str:
        """A job command from the trainer's host (the test's own namespace reaches none)."""
        argv = ["ip", "netns", "exec", network.ns["trainer"], *_swarm(*args)]
        env = _env(certs, "trainer", tmp_path)
        done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    broker_url = f"mqtts://{ADDRESSES['broker']}:1883"
    scheduler = f"{ADDRESSES['scheduler']}:7700"
    try:
        # each client's MQTT user is its certificate's name: "scheduler", and each peer's id
        start(
            "broker",
            "broker",
            *("--host", "0.0.0.0", "--port", "1883"),
            "--use-identity-as-username",
        )
        start(
            "scheduler",
            "scheduler",
            *("--host", "0.0.0.0", "--announce-host", ADDRESSES["scheduler"], "--port", "7700"),
            *("--broker", broker_url, "--store", str(tmp_path / "jobs.sqlite")),
            *("--checkpoint-dir", str(tmp_path / "ckpt"), "--data-root", str(data_root)),
            "--no-embedded-trainer",  # the remote trainer is the job's only one (`RUN_S`)
        )
        for peer in PEERS:
            start(
                peer,
                "stage-server",
                *("--broker", broker_url, "--host", "0.0.0.0", "--port", "7000"),
                *("--announce-host", ADDRESSES[peer], "--peer", peer, "--threads", "1"),
            )
        deadline = time.monotonic() + 240
        # (the broker prints no ready line: its clients wait for it, connecting again)
        ready = {p.name: p.wait_ready(deadline) for p in procs if p.name != "broker"}
        # bound to 0.0.0.0, each announces the address of its own host
        assert ready["scheduler"]["address"] == scheduler
        assert ready["scheduler"]["broker"] == broker_url
        for peer in PEERS:
            assert ready[peer]["address"] == f"{ADDRESSES[peer]}:7000", ready[peer]
        job_id = client("submit", str(job), "--scheduler", scheduler).split()[0]
        looker = namespaces.Looker(network, "trainer", scheduler, _env(certs, "trainer", tmp_path))
        trainer = start("trainer", "trainer", "--scheduler", scheduler, "--job", job_id)
        killed = None
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline:
            held = killed is None  # until the kill, the job holds still while the test looks
            if held:
                os.killpg(trainer.popen.pid, signal.SIGSTOP)
            try:
                status = looker.look(job_id)
                step = int(status.get("step", 0))
                if killed is None and step >= 3:
                    # a peer whose stage keeps another replica: its work is replayed there
                    stages = status.get("stages", [])
                    pools = [s["replicas"] for s in stages if len(s["replicas"]) > 1]
                    if pools:
                        killed = pools[0][0]["peer"]
                        next(p for p in procs if p.name == killed).kill()
            finally:
                if held:
                    os.killpg(trainer.popen.pid, signal.SIGCONT)
            if status["state"] in ("JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED"):
                break
            time.sleep(RUN_S)
        assert status["state"] == "JOB_STATE_SUCCEEDED", status
        assert killed is not None, "no stage had two replicas to kill one of"
        client("export", job_id, "--out", str(tmp_path / "swarm.pt"), "--scheduler", scheduler)
        logs = {p.name: p.log() for p in procs}
        assert not [n for n, text in logs.items() if "Traceback" in text and n != killed]
    finally:
        if looker is not None:
            looker.close()
        for proc in procs:
            proc.kill()
    assert_equal_to_local(job, torch.load(tmp_path / "swarm.pt"), tol=1e-9)
