"""Prometheus finds a live swarm by itself: the real Prometheus server, given only the scheduler's
`/sd` URL, scrapes every process. The `/sd` answer itself: tests/scheduler/test_discovery.py."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from client.sdk import SchedulerClient
from swarm.local.procs import start_local_swarm
from swarm.proto import scheduler_pb2
from tests.support.jobs import write_job
from tests.support.ports import free_address

PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")


ROOT = Path(__file__).resolve().parents[2]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return bytes(response.read())


async def _submit(scheduler: str, job: Path) -> str:
    async with SchedulerClient(scheduler, timeout_s=30) as client:
        return str((await client.submit(job)).job)


async def _status(scheduler: str, job: str) -> scheduler_pb2.JobStatus:
    async with SchedulerClient(scheduler, timeout_s=30) as client:
        return await client.get(job)


async def _cancel(scheduler: str, job: str) -> None:
    async with SchedulerClient(scheduler, timeout_s=30) as client:
        await client.cancel(job)


def _query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    url = f"http://{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    doc = json.loads(_get(url))
    assert doc["status"] == "success", doc
    return list(doc["data"]["result"])


@pytest.mark.slow
def test_prometheus_discovers_a_live_swarm_through_the_scheduler(tmp_path: Path) -> None:
    assert PROMETHEUS and PROMTOOL, "install the Debian package prometheus (make test does)"
    swarm, _ = start_local_swarm([1.0, 1.0], log_dir=tmp_path)
    prometheus = None
    try:
        scheduler = f"127.0.0.1:{swarm.scheduler.ready['metrics']}"
        peers = {f"127.0.0.1:{p.ready['metrics']}" for p in swarm.peers}
        deadline = time.monotonic() + 60
        while True:  # the peers announce themselves over MQTT: /sd follows
            groups = json.loads(_get(f"http://{scheduler}/sd"))
            listed = {t for g in groups for t in g["targets"]}
            if listed == peers | {scheduler} or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert listed == peers | {scheduler}, groups
        for target in listed:  # the linter Prometheus ships agrees with every exposition
            lint = subprocess.run(
                [PROMTOOL, "check", "metrics"],
                input=_get(f"http://{target}/metrics"),
                capture_output=True,
                timeout=30,
            )
            assert lint.returncode == 0, (target, lint.stdout, lint.stderr)
        web = free_address()
        config = tmp_path / "prometheus.yml"
        doc = (ROOT / "docs" / "prometheus.yml").read_text()
        config.write_text(
            doc.replace("SCHEDULER:9100", scheduler)
            .replace("scrape_interval: 15s", "scrape_interval: 1s")
            .replace("refresh_interval: 30s", "refresh_interval: 1s")
        )
        with (tmp_path / "prometheus.log").open("wb") as out:
            prometheus = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address={web}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline, instances = time.monotonic() + 90, set[str]()
        while time.monotonic() < deadline:  # a series of its own from every process
            try:
                found = _query(web, 'count by (instance) ({__name__=~"swarm_.+"})')
            except OSError:  # not listening yet
                found = []
            instances = {r["metric"]["instance"] for r in found}
            if instances == peers | {scheduler}:
                break
            time.sleep(0.5)
        log = (tmp_path / "prometheus.log").read_text()[-2000:]
        assert instances == peers | {scheduler}, log
        up = _query(web, "up")
        assert {r["metric"]["instance"] for r in up if r["value"][1] == "1"} >= peers
        roles = {r["metric"].get("swarm_role") for r in up}
        assert roles == {"scheduler", "peer"}  # the discovery labels came along
        # A job trains while Prometheus watches: every query of the shipped Grafana dashboard is
        # valid PromQL, and every series it reads is scraped while the job runs.
        dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
        exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
        names = set()
        for expr in exprs:
            _query(web, expr.replace("$job", ".*"))  # raises on a PromQL error
            names |= set(re.findall(r"\b(swarm_[a-z_]+)", expr))
        names = {re.sub(r"_bucket$", "", n) for n in names}
        # Counted only when a hop fails, which none does here: the one series never scraped.
        expected = names - {"swarm_trainer_hop_failures_total"}
        job = asyncio.run(
            _submit(
                swarm.address,
                write_job(
                    tmp_path,
                    training={"stages": 2, "steps": 10**6, "eval_every": 2, "eval_microbatches": 1},
                ),
            )
        )
        deadline, seen = time.monotonic() + 120, set[str]()
        while time.monotonic() < deadline and seen != expected:
            seen = {
                name
                for name in names
                if _query(web, f'count(count_over_time({{__name__=~"{name}(_bucket)?"}}[10m]))')
            }
            time.sleep(1)
        status = asyncio.run(_status(swarm.address, job))
        asyncio.run(_cancel(swarm.address, job))
        assert seen == expected, expected - seen
        # The evaluations reached the job's record: `swarm status` shows the newest.
        assert status.HasField("val_loss") and status.val_step % 2 == 0, status
        assert 0 < status.val_loss < 10
        documented = set()  # the names docs/metrics.md lists, `a_{x,y}_b` spelt out
        text = (ROOT / "docs" / "metrics.md").read_text()  # braces inside a name, not labels:
        for name in re.findall(r"swarm_(?:[a-z_]|\{[a-z,]+\}(?=[a-z_]))+", text):
            parts = re.fullmatch(r"([a-z_]*)\{([a-z,]+)\}([a-z_]*)", name)
            alternatives = parts[2].split(",") if parts else [""]
            documented |= {f"{parts[1]}{a}{parts[3]}" for a in alternatives} if parts else {name}
        assert names <= documented, names - documented  # no name nobody exports
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(30)
        swarm.stop()
