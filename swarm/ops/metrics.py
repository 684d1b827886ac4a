"""Prometheus metrics as every process serves them: `/metrics` (and the scheduler's `/sd`) from a
`CollectorRegistry` of the process's own, so tests can run many servers in one process. Each
role's series live with the role (`stage_server/peer/metrics.py`, `client/metrics.py`,
`scheduler/coordinator/metrics.py`) and share the labels and buckets defined here.

Labels are job, stage and peer, plus `method` and `code` on per-RPC series: bounded sets of RPC
names and status codes, which is how Prometheus expects per-method latency to be split.

They list every peer id, address and job, so they let in only what the swarm does
(`swarm.ops.endpoint`): with the process's TLS identity HTTPS only, with a token a bearer token.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import ssl
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, gzip_accepted

from swarm.errors import ConfigError
from swarm.net import tls
from swarm.net.ports import Listener, raise_if_taken
from swarm.ops.endpoint import Answer, Endpoint, Limits

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


def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    routes: dict[str, Route] | None = None,
    *,
    token: str | None = None,
    limits: Limits | None = None,
) -> int:
    """Serve `/metrics` (and `routes`, e.g. the scheduler's `/sd`) on a thread of its own;
    returns the bound port (useful when `port` is 0). With `token`, every request must carry it
    as a bearer token; with the process's TLS identity (`swarm.net.tls`), HTTPS only, with its
    certificate (and a client certificate from the CA required under --tls-mutual). The
    process-wide TLS refusal count comes along. `limits`: the
    endpoint's bounds (`swarm.ops.endpoint.Limits`). `PortInUse` when another process listens on
    `port`."""
    with contextlib.suppress(ValueError):  # served by an earlier call already
        registry.register(tls.REFUSED)
    own = dict(routes or {})

    def answer(path: str, headers: Mapping[str, str]) -> Answer:
        route = own.get(path)
        if route is not None:
            content_type, body = route()
            return Answer(200, body, (("Content-Type", content_type),))
        if path != "/metrics":
            return Answer(404, b"not found\n", (("Content-Type", "text/plain"),))
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        body = encoder(registry)
        if not gzip_accepted(headers.get("accept-encoding", "")):
            return Answer(200, body, (("Content-Type", content_type),))
        return Answer(
            200, gzip.compress(body), (("Content-Type", content_type), ("Content-Encoding", "gzip"))
        )

    identity = tls.current()
    context = None if identity is None else _server_context(identity)
    endpoint = Endpoint(answer, token=token, context=context, limits=limits or Limits())
    try:
        bound = endpoint.start(host, port)
    except OSError as e:
        raise_if_taken(e, host, port, Listener.METRICS)  # the flag is the caller's to name
        raise
    scheme = "http" if context is None else "https"
    log.info("metrics on %s://%s:%d/metrics%s", scheme, host, bound, " (token)" if token else "")
    return bound


def _server_context(identity: tls.Tls) -> ssl.SSLContext:
    """HTTPS with the process's certificate; a client certificate from its CA when mutual."""
    if identity.cert_path is None or identity.key_path is None:
        raise ConfigError(
            "with --tls-ca, /metrics is served over TLS only: give this process --tls-cert and "
            "--tls-key (`swarm certs issue`), or no --metrics-port"
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(identity.cert_path, identity.key_path)
    if identity.mutual:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=identity.ca.decode())
    return context
