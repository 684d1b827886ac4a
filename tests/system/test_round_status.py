"""A local-steps job under a real scheduler: `swarm status` shows its rounds line (the rule, the
round, the steps to the next average, the last average's time and bytes), and the scheduler's
/metrics its round series, which `promtool` accepts; the bytes the coordinator counts are those
the stage servers count sending and receiving in their pools' averaging."""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from swarm.local.procs import start_local_swarm
from tests.support.cli import swarm
from tests.support.jobs import write_job
from tests.support.status import shown_once


@pytest.mark.slow
def test_swarm_status_and_metrics_show_a_local_jobs_rounds(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "install the Debian package prometheus (make test does)"
    training = {"stages": 2, "steps": 10**5, "target_batch_size": 16}
    pool = {"mode": "local", "sync_every": 2}
    job = write_job(tmp_path, training=training, pool=pool)
    sw, _ = start_local_swarm([1.0] * 4, log_dir=tmp_path)  # 2 replicas per stage
    try:
        at = ("--scheduler", sw.address)
        job_id = swarm("submit", str(job), *at).stdout.split()[0]
        out = shown_once(sw.address, job_id, "last average took")
        line = next((x for x in out.splitlines() if x.startswith("rounds")), "")
        shape = (
            r"rounds   local, round (\d+)/50000 \(2 steps each\), next average in [12] steps?; "
            r"last average took \d+(ms|\.\ds), \S+ ago, [\d.]+ (B|KiB|MiB) moved"
        )
        assert re.fullmatch(shape, line), out
        text = _metrics(sw.scheduler.ready["metrics"])
        assert re.search(rf'^swarm_coordinator_round{{job="{job_id}"}} [1-9]', text.decode(), re.M)
        assert f'swarm_coordinator_round_seconds_count{{job="{job_id}"}}' in text.decode()
        lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True)
        assert lint.returncode == 0, (lint.stdout, lint.stderr)
        swarm("cancel", job_id, *at)
        # A job that ends: its rounds' bytes are what its replicas sent and received averaging.
        short = write_job(tmp_path, "short", training=training | {"steps": 8}, pool=pool)
        short_id = swarm("submit", str(short), "--wait", *at).stdout.split()[0]
        counted = _values(sw.scheduler.ready["metrics"], "swarm_coordinator_round_bytes")
        moved = [_values(p.ready["metrics"], "swarm_stage_averaging_bytes_") for p in sw.peers]
        assert counted[short_id] == sum(m.get(short_id, 0.0) for m in moved) > 0, (counted, moved)
    finally:
        sw.stop()


def _metrics(port: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return bytes(response.read())


def _values(port: str, prefix: str) -> dict[str, float]:
    """Per job, the sum of the counters of `port`'s /metrics whose names start with `prefix`."""
    sums: dict[str, float] = {}
    for m in re.finditer(
        rf'^{prefix}\w*_total{{[^}}]*job="([^"]+)"[^}}]*}} (\S+)$', _metrics(port).decode(), re.M
    ):
        sums[m[1]] = sums.get(m[1], 0.0) + float(m[2])
    return sums
