"""A dial-back's verdict on both sides, with real processes over mutual TLS (issue 51, item 2):
a stage server whose certificate names another address than the one it announces (the guide's
home peer: its certificate names its LAN address) is UNREACHABLE with "TLS name mismatch" and the
certificate's remedy in `swarm status`, never the token's; and its own log says so at WARNING.
Before, the scheduler told it to give the same --token-file, and the peer's log looked healthy."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.local.procs import start_local_swarm
from swarm.net.certs import issue
from tests.support.cli import swarm
from tests.support.jobs import write_job
from tests.support.tls import mutual_env, no_identity, pki
from tests.support.waiting import wait_until_blocking

__all__ = ["no_identity", "pki"]  # fixtures

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOKEN = "s3cret"


def test_a_certificate_naming_another_address_is_named_as_such_in_status_and_the_peers_log(
    tmp_path: Path, pki: Path
) -> None:
    ours = pki / "ours"
    issue(ours, "home", ["192.168.1.10"])  # its LAN address; it announces 127.0.0.1
    env = mutual_env(pki, TOKEN)
    client = {**env, "SWARM_TLS_CERT": str(ours / "client.pem")}
    client["SWARM_TLS_KEY"] = str(ours / "client.key")
    job = write_job(tmp_path, training={"stages": 1, "steps": 100_000})
    sw, _ = start_local_swarm([], log_dir=tmp_path, env=env)
    try:
        sw.env = {**env, "SWARM_TLS_CERT": str(ours / "home.pem")}
        sw.env["SWARM_TLS_KEY"] = str(ours / "home.key")
        home = sw.add_peer()
        submitted = swarm("submit", str(job), "--scheduler", sw.address, env=client)
        job_id = submitted.stdout.split()[0]

        def status() -> str | None:
            shown = swarm("status", job_id, "--scheduler", sw.address, env=client).stdout
            return shown if "TLS name mismatch" in shown else None

        shown = wait_until_blocking(status, "status names the TLS name mismatch", every_s=0.5)
        assert "does not name 127.0.0.1" in shown and "swarm certs issue" in shown, shown
        assert "--token-file" not in shown, shown
        said = wait_until_blocking(
            lambda: [line for line in home.log().splitlines() if "TLS name mismatch" in line],
            "the peer's log names the TLS name mismatch",
        )
        assert "WARNING" in said[0] and "does not name 127.0.0.1" in said[0], said
    finally:
        sw.stop()
