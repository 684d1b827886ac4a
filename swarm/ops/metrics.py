"""Prometheus metrics as every process serves them: `/metrics` (and the scheduler's `/sd`) from a
`CollectorRegistry` of the process's own, so tests can run many servers in one process. Each
role's series live with the role (`stage_server/metrics.py`, `client/metrics.py`,
`scheduler/coordinator/metrics.py`) and share the labels and buckets defined here.

Labels are job, stage and peer, plus `method` and `code` on per-RPC series: bounded sets of RPC
names and status codes, which is how Prometheus expects per-method latency to be split.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    make_wsgi_app,
    start_http_server,
)

from swarm.net import tls

__all__ = [
    "LABELS",
    "LATENCY_BUCKETS",
    "serve_metrics",
]

log = logging.getLogger(__name__)

# Hop latencies range from a millisecond (tiny stages) to tens of seconds (big stages on slow
# devices); exponential buckets cover that.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
LABELS = ("job", "stage", "peer")  # every series of a role is labelled by these


# path -> what it answers: (content type, body), computed per request on the server's thread
Route = Callable[[], tuple[str, bytes]]


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes are not news
        pass


def serve_metrics(
    registry: CollectorRegistry, host: str, port: int, routes: dict[str, Route] | None = None
) -> int:
    """Serve `/metrics` (and `routes`, e.g. the scheduler's `/sd`) on daemon threads; returns the
    bound port (useful when `port` is 0). The process-wide TLS refusal count comes along."""
    with contextlib.suppress(ValueError):  # served by an earlier call already
        registry.register(tls.REFUSED)
    if not routes:
        server, _thread = start_http_server(port, addr=host, registry=registry)
        bound = int(server.server_address[1])
    else:
        metrics = make_wsgi_app(registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            route = routes.get(environ.get("PATH_INFO", ""))
            if route is None:
                return metrics(environ, start_response)  # type: ignore[no-any-return]
            content_type, body = route()
            start_response("200 OK", [("Content-Type", content_type)])
            return [body]

        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]

        class Server(ThreadingMixIn, WSGIServer):
            daemon_threads = True
            address_family = family

        httpd = make_server(host, port, app, Server, handler_class=_Quiet)
        threading.Thread(target=httpd.serve_forever, daemon=True, name="metrics").start()
        bound = int(httpd.server_address[1])
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
