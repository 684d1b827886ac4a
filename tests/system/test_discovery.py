"""Prometheus finds a live swarm by itself: the real Prometheus server, given only the scheduler's
`/sd` URL, scrapes every process, with TLS and the metrics token too. A peer's target labels stay
the same whatever it does (one series per peer, never split); what it does is its
`swarm_peer_info`, and what it became is in its log, once each, at the default level. The `/sd`
answer itself: tests/scheduler/test_discovery.py; the endpoint's checks:
tests/swarm/ops/test_metrics.py."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from client.sdk import SchedulerClient
from swarm.local.procs import start_local_swarm
from swarm.proto import scheduler_pb2
from tests.support.jobs import write_job
from tests.support.ports import free_address
from tests.support.tls import mutual_env

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


def _peer_info(target: str) -> list[dict[str, str]]:
    """The labels of every `swarm_peer_info` series a peer's /metrics shows now."""
    text = _get(f"http://{target}/metrics").decode()
    return [
        dict(s.labels)
        for family in text_string_to_metric_families(text)
        if family.name == "swarm_peer_info"
        for s in family.samples
    ]


def _doing(target: str) -> list[dict[str, str]]:
    """What each `swarm_peer_info` series of a peer says it does (its reachability aside)."""
    keep = ("peer", "state", "job", "stage")
    return [{k: v for k, v in s.items() if k in keep} for s in _peer_info(target)]


def _query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    url = f"http://{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    doc = json.loads(_get(url))
    assert doc["status"] == "success", doc
    return list(doc["data"]["result"])


def _prometheus_finds(
    tmp_path: Path, config: str, targets: set[str], wait_s: float
) -> tuple[subprocess.Popen[bytes], str]:
    """Start the real Prometheus on `config` (scrapes and discovery every second) and wait until
    it holds a series of its own from every target; its process and its web address."""
    path = tmp_path / "prometheus.yml"
    path.write_text(
        config.replace("scrape_interval: 15s", "scrape_interval: 1s").replace(
            "refresh_interval: 30s", "refresh_interval: 1s"
        )
    )
    web = free_address()
    with (tmp_path / "prometheus.log").open("wb") as out:
        prometheus = subprocess.Popen(
            [
                PROMETHEUS or "prometheus",
                f"--config.file={path}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address={web}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline, instances = time.monotonic() + wait_s, set[str]()
    while time.monotonic() < deadline:  # a series of its own from every process
        try:
            found = _query(web, 'count by (instance) ({__name__=~"swarm_.+"})')
        except OSError:  # not listening yet
            found = []
        instances = {r["metric"]["instance"] for r in found}
        if instances == targets:
            break
        time.sleep(0.5)
    if instances != targets:
        prometheus.terminate()
        prometheus.wait(30)
        log = (tmp_path / "prometheus.log").read_text()[-2000:]
        raise AssertionError(f"Prometheus found {instances}, not {targets}: {log}")
    return prometheus, web


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
        labels = {g["targets"][0]: g["labels"] for g in groups}
        for target in peers:  # idle until a job comes: one series saying so
            assert [i["state"] for i in _peer_info(target)] == ["idle"], _peer_info(target)
        for target in listed:  # the linter Prometheus ships agrees with every exposition
            lint = subprocess.run(
                [PROMTOOL, "check", "metrics"],
                input=_get(f"http://{target}/metrics"),
                capture_output=True,
                timeout=30,
            )
            assert lint.returncode == 0, (target, lint.stdout, lint.stderr)
        doc = (ROOT / "docs" / "prometheus.yml").read_text().replace("SCHEDULER:9100", scheduler)
        prometheus, web = _prometheus_finds(tmp_path, doc, peers | {scheduler}, 90)
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
        serving = {
            r["metric"]["peer"]: (r["metric"]["state"], r["metric"]["job"], r["metric"]["stage"])
            for r in _query(web, "swarm_peer_info")
        }
        asyncio.run(_cancel(swarm.address, job))
        assert seen == expected, expected - seen
        # Each peer went idle -> measuring -> waiting -> serving: one `swarm_peer_info` series at a
        # time, its /sd labels unchanged, so its target (`up`) was one series all along.
        assert sorted(serving.values()) == [("serving", job, "0"), ("serving", job, "1")], serving
        assert len(_query(web, "swarm_peer_info")) == len(peers)
        ups = _query(web, 'count by (instance) (count_over_time(up{swarm_role="peer"}[10m]))')
        assert {r["metric"]["instance"]: r["value"][1] for r in ups} == dict.fromkeys(peers, "1")
        now = json.loads(_get(f"http://{scheduler}/sd"))
        assert {g["targets"][0]: g["labels"] for g in now} == labels
        idle = {
            t: [{"peer": labels[t]["swarm_peer"], "state": "idle", "job": "", "stage": ""}]
            for t in peers
        }
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # released by the cancelled job: idle again
            if all(_doing(t) == idle[t] for t in peers):
                break
            time.sleep(0.2)
        assert {t: _doing(t) for t in peers} == idle
        for t in peers:  # how others reach it: on one host, directly (unknown before a dial-back)
            (series,) = _peer_info(t)
            assert series["reachability"] in ("unknown", "direct") and series["relay"] == "", series
        swarm.stop()  # each peer says why it stopped
        for peer in swarm.peers:  # at the default level: what it became, once each; no steps
            log, stage = peer.log(), serving[peer.ready["peer"]][2]
            for line in (
                f"measured for job {job}:",
                f"assigned stage {stage} of job {job} (layers ",
                f"serving stage {stage} of job {job}",
                f"released stage {stage} of job {job}: it was cancelled",
                "stopped (SIGTERM or SIGINT) while idle",
            ):
                assert log.count(line) == 1, (line, log)
            assert "committed step" not in log, log
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


def _fetch(
    url: str, context: ssl.SSLContext | None = None, token: str | None = None
) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.slow
def test_prometheus_scrapes_a_swarm_over_mutual_tls_with_the_metrics_token(
    tmp_path: Path, pki: Path
) -> None:
    """With TLS and a token, /sd and every /metrics are HTTPS only (a client certificate
    required under --tls-mutual) and need the metrics token, not the swarm's: Prometheus,
    configured as docs/prometheus-tls.yml says, still finds and scrapes every process."""
    assert PROMETHEUS, "install the Debian package prometheus (make test does)"
    ours = pki / "ours"
    env = mutual_env(pki, "s3cret") | {"SWARM_METRICS_TOKEN": "watch-only"}
    swarm, _ = start_local_swarm([1.0], log_dir=tmp_path, env=env)
    prometheus = None
    try:
        scheduler = f"127.0.0.1:{swarm.scheduler.ready['metrics']}"
        peers = {f"127.0.0.1:{p.ready['metrics']}" for p in swarm.peers}
        client = ssl.create_default_context(cafile=str(ours / "ca.pem"))
        client.load_cert_chain(str(ours / "client.pem"), str(ours / "client.key"))
        with pytest.raises((OSError, http.client.HTTPException)):  # clear text: no answer
            _fetch(f"http://{scheduler}/sd", token="watch-only")
        for target in (scheduler, *peers):  # a certificate is no pass, nor the swarm token
            for path in ("/metrics", "/sd"):
                for token in (None, "s3cret"):
                    assert _fetch(f"https://{target}{path}", client, token)[0] == 401
        deadline = time.monotonic() + 60
        while True:  # the peer announces itself over MQTT: /sd follows
            status, body = _fetch(f"https://{scheduler}/sd", client, "watch-only")
            assert status == 200, body
            listed = {t for g in json.loads(body) for t in g["targets"]}
            if listed == peers | {scheduler} or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert listed == peers | {scheduler}
        files = tmp_path / "prometheus"
        files.mkdir()
        (files / "metrics-token").write_text("watch-only\n")
        config = (
            (ROOT / "docs" / "prometheus-tls.yml")
            .read_text()
            .replace("SCHEDULER:9100", scheduler)
            .replace("/etc/prometheus/swarm/ca.pem", str(ours / "ca.pem"))
            .replace("/etc/prometheus/swarm/prometheus.pem", str(ours / "client.pem"))
            .replace("/etc/prometheus/swarm/prometheus.key", str(ours / "client.key"))
            .replace("/etc/prometheus/swarm/metrics-token", str(files / "metrics-token"))
        )
        prometheus, _ = _prometheus_finds(tmp_path, config, peers | {scheduler}, 60)
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(30)
        swarm.stop()
