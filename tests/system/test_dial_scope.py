"""Issue 54, M-scan: the dial-back is no port scanner. A scheduler process whose dial-back keeps to
public addresses (`--dial-scope public`, what 'auto' chooses for a scheduler that announces a
public address or a name) dials no private or loopback address a peer announces: a real stage
server on this machine's loopback is reported UNREACHABLE, "a private address, not dialled",
with the remedy, in `swarm status` and in the peer's own log, which reads the cause only.
(Before, the scheduler dialled whatever a peer announced, its own loopback included, and handed
the peer the raw gRPC error.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.local.procs import start_local_swarm
from tests.support.cli import swarm
from tests.support.jobs import write_job
from tests.support.status import shown_once
from tests.support.waiting import wait_until_blocking

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.attack("M-scan")]


def test_a_scheduler_without_dial_private_dials_no_loopback_address(tmp_path: Path) -> None:
    job = write_job(tmp_path, training={"stages": 1, "steps": 100_000})
    sw, _ = start_local_swarm(
        [],
        log_dir=tmp_path,
        dial_private=False,
        env={"SWARM_DIAL_PRIVATE": "0"},
        extra_scheduler=["--dial-scope", "public"],  # 'auto' allows loopback to one on loopback
    )
    try:
        peer = sw.add_peer()  # on 127.0.0.1, announced there
        job_id = swarm("submit", str(job), "--scheduler", sw.address).stdout.split()[0]
        shown = shown_once(sw.address, job_id, "UNREACHABLE")
        assert "a private address, not dialled" in shown and "--dial-private" in shown, shown
        told = wait_until_blocking(
            lambda: (
                line
                if (
                    line := next((x for x in peer.log().splitlines() if "not reachable" in x), None)
                )
                else None
            ),
            "peer0 logs what the scheduler told it",
            every_s=0.5,
        )
        assert "a private address, not dialled" in told, told
        assert "dials only public ones" not in told  # the scheduler's own words stay its own
        assert f"job {job_id}: stage 0 -> peer0" not in sw.scheduler.log()
    finally:
        sw.stop()
