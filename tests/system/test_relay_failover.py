"""A relay SIGKILLed mid-step is one more failure (issue 42, item 4), on loopback with real
processes: a scheduler (embedded broker and trainer), two `swarm relay` processes, a direct stage
server and one "behind NAT" (it listens on 127.0.0.1 and announces 127.0.0.2, where nothing
answers, so it is reached only through the relay it attached to). Stage `NAT_STAGE`'s only
replica is the NAT'd one. Its relay is killed in the middle of the job: the peer re-attaches to
the other relay, the step goes on, nothing rolls back (a path exists), and the job ends equal to
`swarm local`. Also the issue's target: the NAT'd peer reads "relayed through ..." within 10 s
of its start. The namespace lab with real NAT routers is tests/system/test_nat_serving.py."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from swarm.local.procs import LocalSwarm, SwarmProcess, start_local_swarm, start_process
from tests.support.cli import swarm
from tests.support.equality import assert_equal_to_local
from tests.support.jobs import write_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RELAYED_WITHIN_S = 10.0
"""Issue 42's target: a NAT'd peer's state reads "relayed through ..." within 10 s of its start."""


def _until(condition: Callable[[], Any], what: str, timeout_s: float = 120) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = condition()
        if answer:
            return answer
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s:.0f} s: {what}")


def _metrics(process: SwarmProcess) -> str:
    url = f"http://127.0.0.1:{process.ready['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as answer:
        text: str = answer.read().decode()
    return text


def _status(sw: LocalSwarm, job_id: str) -> dict[str, Any]:
    out = swarm("status", job_id, "--json", "--scheduler", sw.address, check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def _replica(status: dict[str, Any], peer: str) -> dict[str, Any] | None:
    for stage in status.get("stages", []):
        for r in stage.get("replicas", []):
            if r["peer"] == peer:
                return dict(r)
    return None


def _relay(process: SwarmProcess) -> tuple[str, SwarmProcess]:
    return process.ready["address"], process


def _rollbacks(metrics: str) -> float:
    found = re.findall(r"^swarm_coordinator_rollbacks_total\{[^}]*\} (\S+)$", metrics, re.M)
    return sum(float(v) for v in found)


def _start_relay(sw: LocalSwarm, name: str) -> SwarmProcess:
    relay = start_process(
        ["--log-level", "INFO", "relay", "--broker", sw.broker, "--port", "0",
         "--peer", name, "--metrics-port", "0"],
        log_dir=sw.log_dir, name=name, env=sw.env,
    )  # fmt: skip
    relay.wait_ready(60)
    return relay


def test_a_relay_killed_mid_step_is_replaced_without_a_rollback_and_stays_exact(
    tmp_path: Path,
) -> None:
    steps = 16
    job = write_job(
        tmp_path,
        training={"stages": 2, "steps": steps, "target_batch_size": 16, "checkpoint_every": 4},
    )
    sw, _ = start_local_swarm([], log_dir=tmp_path)
    relays: list[SwarmProcess] = []
    try:
        relays = [_start_relay(sw, "relay-a"), _start_relay(sw, "relay-b")]
        by_address = dict(_relay(r) for r in relays)
        sw.add_peer(10.0)  # peer0: direct
        # peer1 listens on 127.0.0.1 and announces 127.0.0.2, where nothing answers: it is
        # "behind NAT", reached only through a relay (--behind-nat: it attaches at its start).
        nat = sw.add_peer(10.0, extra=["--announce-host", "127.0.0.2", "--behind-nat"])
        started = time.monotonic()  # its ready line
        relayed = 'swarm_peer_reachability{peer="peer1",reachability="relayed"} 1.0'
        _until(lambda: relayed in _metrics(sw.scheduler), "peer1 relayed", 60)
        took = time.monotonic() - started
        assert took <= RELAYED_WITHIN_S, f"peer1 read relayed {took:.1f} s after its start"

        job_id = swarm("submit", str(job), "--scheduler", sw.address).stdout.split()[0]
        # Mid-job: peer1 serves its stage through its relay, and a few steps are done.
        serving = _until(
            lambda: (s := _status(sw, job_id))
            and 2 <= int(s.get("step", 0)) < steps - 4
            and (r := _replica(s, "peer1"))
            and r.get("relay") in by_address
            and r,
            "peer1 serving through a relay, a few steps in",
            240,
        )
        first = serving["relay"]
        other = next(a for a in by_address if a != first)
        by_address[first].kill()  # SIGKILL: the relay says no goodbye

        again = _until(
            lambda: (r := _replica(_status(sw, job_id), "peer1"))
            and r.get("relay") == other
            and r,
            "peer1 re-attached to the other relay",
            120,
        )
        assert again["reachability"] == "REACHABILITY_RELAYED", again

        _until(lambda: int(_status(sw, job_id).get("step", 0)) >= steps, "the job's end", 300)
        swarm("export", job_id, "--out", str(tmp_path / "swarm.pt"), "--scheduler", sw.address)
        assert _rollbacks(_metrics(sw.scheduler)) == 0, "a rollback while another path existed"
        assert "rolled back" not in sw.scheduler.log()
    finally:
        sw.stop()
        for relay in relays:
            relay.stop()
    assert_equal_to_local(job, torch.load(tmp_path / "swarm.pt"), tol=1e-9)
    # It went from one relay to the other, never announced without one (nobody could call it
    # then, and it warned that no other relay answers while one did).
    said = nat.log()
    assert f"relay {first} is gone; attached to relay {other} instead" in said, said[-3000:]
    assert "no other relay answers" not in said, said[-3000:]
