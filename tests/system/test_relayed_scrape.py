"""Prometheus scrapes a peer behind NAT through its relay: the real Prometheus server, configured
as docs/prometheus.yml (an open swarm: a plain HTTP proxy request) or docs/prometheus-tls.yml
(TLS and a token: a CONNECT with the relay's metrics credential, TLS end to end to the peer's
own certificate) says word for word, finds the peer at the scheduler's `/sd`, labelled with its
relay, and scrapes its `/metrics` through the relay. The peer listens on 127.0.0.1 and announces
127.0.0.2, where nothing answers: only the relay reaches it. Its attachment and the relay are the
real ones, in this process; the relay's refusals: tests/swarm/net/test_relay_attacks.py (R5)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from scheduler.discovery import sd_document
from stage_server.peer.metrics import StageMetrics
from swarm.cli import main
from swarm.net import tls
from swarm.net.certs import issue
from swarm.ops.metrics import serve_metrics
from swarm.proto import control_pb2 as cpb
from swarm.relay.attach import Attachment
from swarm.relay.auth import metrics_credential
from swarm.relay.server import RelayServer
from tests.support.guide import blocks
from tests.support.ports import free_address
from tests.support.tls import no_identity, pki

__all__ = ["no_identity", "pki"]

PROMETHEUS = shutil.which("prometheus")
ROOT = Path(__file__).resolve().parents[2]
TOKEN = "relayed-scrape-token"
PEER, ANNOUNCED_HOST = "home-gpu", "127.0.0.2"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return bytes(response.read())


def _query(web: str, expr: str) -> list[dict[str, Any]]:
    url = f"http://{web}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    doc = json.loads(_get(url))
    assert doc["status"] == "success", doc
    return list(doc["data"]["result"])


@contextlib.asynccontextmanager
async def _nat_peer(token: str | None) -> AsyncIterator[tuple[str, str, CollectorRegistry]]:
    """A relay on 127.0.0.1, a NAT'd peer's /metrics (its real series) on 127.0.0.1 attached to
    it and announced at 127.0.0.2, and the scheduler's `/sd` listing it: the /sd address, the
    relay's and the relay's registry."""
    registry = CollectorRegistry()
    relay = RelayServer(token, registry=registry)
    relay_address = f"127.0.0.1:{await relay.start('127.0.0.1', 0)}"
    metrics = StageMetrics(PEER)
    metrics.reached("relayed", relay_address)
    port = serve_metrics(metrics.registry, "127.0.0.1", 0, token=token)
    announced = f"{ANNOUNCED_HOST}:{port}"
    with pytest.raises(ConnectionRefusedError):  # nobody answers where it says it is
        socket.create_connection((ANNOUNCED_HOST, port), timeout=5).close()
    peer = cpb.PeerAnnouncement(
        peer=PEER,
        address=f"{ANNOUNCED_HOST}:1",
        metrics_address=announced,
        state=cpb.PEER_STATE_JOINING,
        relay=relay_address,
    )
    sd = [""]

    def listing() -> tuple[str, bytes]:
        return sd_document(sd[0], [peer], lambda p: p == PEER)  # reached through its relay

    sd_port = serve_metrics(CollectorRegistry(), "127.0.0.1", 0, {"/sd": listing}, token=token)
    sd[0] = f"127.0.0.1:{sd_port}"
    attachment = Attachment(
        PEER,
        token,
        f"127.0.0.1:{port + 1}",
        lambda: [relay_address],
        lambda _: None,
        address=peer.address,
        local_metrics=f"127.0.0.1:{port}",
        metrics_address=announced,
    )
    await attachment.start()
    try:
        while attachment.relay is None:
            await asyncio.sleep(0.05)
        yield sd[0], relay_address, registry
    finally:
        await attachment.stop()
        await relay.stop()


async def _scraped(tmp_path: Path, config: str) -> list[dict[str, Any]]:
    """Run Prometheus on `config` (every second) until it scraped a `swarm_` series from the
    NAT'd peer; the `up` series of its target."""
    path = tmp_path / "prometheus.yml"
    path.write_text(
        config.replace("scrape_interval: 15s", "scrape_interval: 1s").replace(
            "refresh_interval: 30s", "refresh_interval: 1s"
        )
    )
    web = free_address()
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
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
    try:
        loop = asyncio.get_running_loop()
        deadline, found = loop.time() + 90, list[dict[str, Any]]()
        expr = f'swarm_peer_info{{peer="{PEER}",reachability="relayed"}}'
        while loop.time() < deadline and not found:
            with contextlib.suppress(OSError):  # not listening yet
                found = await asyncio.to_thread(_query, web, expr)
            await asyncio.sleep(0.5)
        assert found, log.read_text()[-3000:]
        (series,) = found
        assert series["metric"]["instance"].startswith(f"{ANNOUNCED_HOST}:"), series
        return await asyncio.to_thread(_query, web, f'up{{swarm_peer="{PEER}"}}')
    finally:
        prometheus.terminate()
        prometheus.wait(30)


def _one_up(ups: list[dict[str, Any]]) -> None:
    """One target for the peer, scraped through the relay and up: no other job tried its
    announced address."""
    assert [(u["metric"]["job"], u["value"][1]) for u in ups] == [("swarm-relayed", "1")], ups


async def test_prometheus_scrapes_a_nat_peer_through_its_relay(tmp_path: Path) -> None:
    assert PROMETHEUS, "install the Debian package prometheus (make test does)"
    async with _nat_peer(None) as (sd, relay, registry):
        groups = json.loads(await asyncio.to_thread(_get, f"http://{sd}/sd"))
        relayed = [g for g in groups if g["labels"].get("swarm_peer") == PEER]
        assert relayed[0]["labels"]["__meta_swarm_relay"] == relay
        config = (
            (ROOT / "docs" / "prometheus.yml")
            .read_text()
            .replace("SCHEDULER:9100", sd)
            .replace("RELAY:7100", relay)
        )
        _one_up(await _scraped(tmp_path, config))
        assert (registry.get_sample_value("swarm_relay_tunnels_total") or 0) >= 1


async def test_prometheus_scrapes_a_nat_peer_through_its_relay_over_tls(
    tmp_path: Path, pki: Path
) -> None:
    """TLS and a token: the scrape is a CONNECT with the relay's metrics credential (no peer
    named, one job for every peer the relay carries), TLS end to end: Prometheus verifies the
    peer's own certificate (for its announced host) and shows it the metrics token."""
    assert PROMETHEUS, "install the Debian package prometheus (make test does)"
    ours = pki / "ours"
    issue(ours, "nat", ["127.0.0.1", ANNOUNCED_HOST])
    tls.configure(tls.Tls.load(ours / "ca.pem", ours / "nat.pem", ours / "nat.key", mutual=True))
    async with _nat_peer(TOKEN) as (sd, relay, registry):
        files = tmp_path / "prometheus"
        files.mkdir()
        (files / "metrics-token").write_text(f"{TOKEN}\n")
        config = (
            (ROOT / "docs" / "prometheus-tls.yml")
            .read_text()
            .replace("SCHEDULER:9100", sd)
            .replace("RELAY:7100", relay)
            .replace("RELAY_CREDENTIAL", metrics_credential(TOKEN))
            .replace("/etc/prometheus/swarm/ca.pem", str(ours / "ca.pem"))
            .replace("/etc/prometheus/swarm/prometheus.pem", str(ours / "client.pem"))
            .replace("/etc/prometheus/swarm/prometheus.key", str(ours / "client.key"))
            .replace("/etc/prometheus/swarm/metrics-token", str(files / "metrics-token"))
        )
        _one_up(await _scraped(tmp_path, config))
        assert (registry.get_sample_value("swarm_relay_tunnels_total") or 0) >= 1
        assert not registry.get_sample_value("swarm_relay_refused_total", {"reason": "credential"})


def test_the_relays_metrics_credential_is_printed_as_the_doc_says(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/prometheus-tls.yml's RELAY_CREDENTIAL comes from `swarm relay
    --print-metrics-credential`, as the guide's section 4 says: the one the relay takes (the
    same for every relay: derived from the token)."""
    command = "swarm relay --print-metrics-credential"
    assert command in (ROOT / "docs" / "prometheus-tls.yml").read_text()
    assert f"{command}\n" in blocks("## 4. Prometheus and Grafana")  # the guide's block
    monkeypatch.setenv("SWARM_TOKEN", TOKEN)
    assert main(["relay", "--print-metrics-credential"]) == 0
    assert capsys.readouterr().out.strip() == metrics_credential(TOKEN)
