"""The metrics endpoint lets no one in (`swarm.ops.metrics.serve_metrics`, what every process serves
`/metrics` and the scheduler `/sd` with): a scrape without the metrics token is refused, with a
TLS identity it is HTTPS only (mutual when the identity says so), and a flood of idle connections
neither grows the process's threads nor its open sockets, while a real scrape still answers."""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from swarm.net import tls
from swarm.net.certs import init_ca, issue
from swarm.ops.endpoint import Limits
from swarm.ops.metrics import serve_metrics
from tests.support.tls import no_identity  # noqa: F401
from tests.support.waiting import wait_until_blocking

PEERS = b'[{"targets": ["10.0.0.2:9101"], "labels": {"swarm_peer": "p1"}}]'


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    init_ca(root)
    issue(root, "server", ["127.0.0.1", "localhost"])
    issue(root, "client", ["127.0.0.1", "localhost"])
    return root


def _serve(token: str | None = None, limits: Limits | None = None) -> int:
    registry = CollectorRegistry()
    Counter("swarm_test_scrapes", "a series to find", registry=registry).inc()
    routes = {"/sd": lambda: ("application/json", PEERS)}
    return serve_metrics(registry, "127.0.0.1", 0, routes, token=token, limits=limits or Limits())


def _get(
    url: str, authorization: str | None = None, context: ssl.SSLContext | None = None
) -> tuple[int, bytes]:
    headers = {"Authorization": authorization} if authorization else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=10, context=context
        ) as answer:
            return int(answer.status), bytes(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_a_scrape_without_the_token_is_refused() -> None:
    port = _serve(token="s3cret")
    for path, shown in (("/metrics", b"swarm_test_scrapes_total 1.0"), ("/sd", PEERS)):
        url = f"http://127.0.0.1:{port}{path}"
        for authorization in (None, "Bearer wrong", "Basic czNjcmV0", "Bearer s3cret2", "s3cret"):
            status, body = _get(url, authorization)
            assert status == 401, (path, authorization, status)
            assert b"p1" not in body and b"swarm_test" not in body
        status, body = _get(url, "Bearer s3cret")
        assert status == 200 and shown in body, (path, status, body[:200])
        assert _get(url, "bearer s3cret")[0] == 200  # the scheme is case-insensitive
    assert _get(f"http://127.0.0.1:{port}/other", "Bearer s3cret")[0] == 404


def test_without_a_token_the_endpoint_stays_open() -> None:
    port = _serve()
    status, body = _get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200 and b"swarm_test_scrapes_total 1.0" in body
    assert _get(f"http://127.0.0.1:{port}/sd") == (200, PEERS)


def _https(pki: Path, client: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if client:
        context.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
    return context


def test_with_a_tls_identity_the_endpoint_is_https_only(pki: Path) -> None:
    tls.configure(tls.Tls.load(pki / "ca.pem", pki / "server.pem", pki / "server.key"))
    port = _serve(token="s3cret")
    with pytest.raises((OSError, http.client.HTTPException)):  # clear text: no answer
        _get(f"http://127.0.0.1:{port}/sd", "Bearer s3cret")
    url = f"https://127.0.0.1:{port}/sd"
    assert _get(url, "Bearer s3cret", _https(pki, client=False)) == (200, PEERS)
    assert _get(url, None, _https(pki, client=False))[0] == 401  # TLS is no pass: the token too
    stranger = ssl.create_default_context()  # trusts the system's CAs, not the swarm's
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        _get(url, "Bearer s3cret", stranger)


def test_mutual_tls_requires_a_client_certificate_of_the_ca(pki: Path) -> None:
    tls.configure(tls.Tls.load(pki / "ca.pem", pki / "server.pem", pki / "server.key", True))
    port = _serve()
    url = f"https://127.0.0.1:{port}/metrics"
    with pytest.raises((OSError, http.client.HTTPException)):
        _get(url, None, _https(pki, client=False))
    assert _get(url, None, _https(pki, client=True))[0] == 200


def test_a_tls_identity_without_a_certificate_cannot_serve(pki: Path) -> None:
    tls.configure(tls.Tls.load(pki / "ca.pem"))
    with pytest.raises(Exception, match="--tls-cert"):
        _serve()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_idle_connections_neither_grow_threads_nor_sockets_and_a_scrape_answers() -> None:
    limits = Limits(connections=16)
    port = _serve(token="s3cret", limits=limits)
    threads, fds = threading.active_count(), _open_fds()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(200)]
    try:
        status, body = _get(f"http://127.0.0.1:{port}/metrics", "Bearer s3cret")
        assert status == 200 and b"swarm_test_scrapes_total" in body
        assert threading.active_count() <= threads + 2, threading.active_count() - threads
        # The server side holds at most `connections` of them (the oldest are dropped); the
        # test's own 200 ends are open on top, and a few to spare for the rest of the process.
        bound = limits.connections + 16
        wait_until_blocking(
            lambda: _open_fds() - fds - len(idle) <= bound,
            lambda: f"the server's descriptors within {bound}: {_open_fds() - fds - len(idle)}",
            timeout_s=10,
            every_s=0.05,
        )
    finally:
        for s in idle:
            s.close()


def test_a_client_that_sends_nothing_is_dropped_after_the_request_time() -> None:
    port = _serve(limits=Limits(request_s=0.2))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as idle:
        idle.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
        try:
            answer = idle.recv(1024)  # the server closes it (a 10 s timeout here otherwise)
        except ConnectionResetError:
            answer = b""
        assert answer == b""
