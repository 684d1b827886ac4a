"""Prometheus metrics. Each process builds its metrics on its own `CollectorRegistry` (so tests can
run many servers in one process) and serves it on `/metrics`.

Labels are job, stage and peer, plus `method` and `code` on per-RPC series: bounded sets of RPC
names and status codes, which is how Prometheus expects per-method latency to be split.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    make_wsgi_app,
    start_http_server,
)

from swarm.net import tls

__all__ = [
    "LATENCY_BUCKETS",
    "CoordinatorFamilies",
    "CoordinatorMetrics",
    "StageMetrics",
    "TrainerMetrics",
    "serve_metrics",
]

log = logging.getLogger(__name__)

# Hop latencies range from a millisecond (tiny stages) to tens of seconds (big stages on slow
# devices); exponential buckets cover that.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_LABELS = ("job", "stage", "peer")


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


class StageMetrics:
    """A stage server's series. The job and stage labels change when the peer is assigned a
    stage (`bind`); the series of earlier assignments stay, as counters should."""

    def __init__(self, peer: str, registry: CollectorRegistry | None = None) -> None:
        reg = self.registry = registry or CollectorRegistry()
        self.values = {"job": "", "stage": "", "peer": peer}

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(name, doc, [*_LABELS, *extra], registry=reg)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, _LABELS, registry=reg)

        self._requests = counter("swarm_stage_requests_total", "RPCs handled", "method", "code")
        self._latency = Histogram(
            "swarm_stage_request_seconds",
            "RPC handling time by method",
            [*_LABELS, "method"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self._samples = counter("swarm_stage_samples_total", "Samples accumulated by Backward")
        self._wire_in = counter(
            "swarm_stage_wire_bytes_received_total", "Tensor bytes received, as encoded on the wire"
        )
        self._raw_in = counter(
            "swarm_stage_raw_bytes_received_total",
            "Tensor bytes received, decoded (before compression)",
        )
        self._wire_out = counter(
            "swarm_stage_wire_bytes_sent_total", "Tensor bytes sent, as encoded on the wire"
        )
        self._raw_out = counter(
            "swarm_stage_raw_bytes_sent_total", "Tensor bytes sent, before compression"
        )
        self._steps = counter("swarm_stage_optimizer_steps_total", "Optimizer steps applied")
        self._queue = gauge("swarm_stage_queue_depth", "Compute requests waiting or running")
        self._pending = gauge(
            "swarm_stage_pending_receipts", "Microbatches accumulated for the current step"
        )
        self._step = gauge("swarm_stage_step", "Steps committed on this replica")
        self._avg_seconds = Histogram(
            "swarm_stage_averaging_seconds",
            "Time of a pool's averaging round",
            _LABELS,
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self._avg_sent = counter(
            "swarm_stage_averaging_bytes_sent_total",
            "Gradient bytes sent to the pool while averaging",
        )
        self._avg_received = counter(
            "swarm_stage_averaging_bytes_received_total",
            "Gradient bytes received from the pool while averaging",
        )
        # 1 from the start, labelled with the peer id: an idle peer (no job yet, so no other
        # series) is still seen by whoever scrapes it.
        self._info = Gauge("swarm_peer_info", "This stage server (1)", ["peer"], registry=reg)
        self.identify(peer)

    def identify(self, peer: str) -> None:
        """The peer id is `peer` (known once the server listens: it may default to its address)."""
        self._info.clear()
        self._info.labels(peer=peer).set(1)
        self.values = {**self.values, "peer": peer}

    def bind(self, job: str, stage: int) -> None:
        self.values = {**self.values, "job": job, "stage": str(stage)}

    def observe(self, method: str, code: str, seconds: float) -> None:
        self._requests.labels(**self.values, method=method, code=code).inc()
        self._latency.labels(**self.values, method=method).observe(seconds)

    def received(self, wire_bytes: int, raw_bytes: int) -> None:
        self._wire_in.labels(**self.values).inc(wire_bytes)
        self._raw_in.labels(**self.values).inc(raw_bytes)

    def sent(self, wire_bytes: int, raw_bytes: int) -> None:
        self._wire_out.labels(**self.values).inc(wire_bytes)
        self._raw_out.labels(**self.values).inc(raw_bytes)

    def accumulated(self, samples: int, pending: int) -> None:
        self._samples.labels(**self.values).inc(samples)
        self._pending.labels(**self.values).set(pending)

    def committed(self, step: int, applied: bool) -> None:
        if applied:
            self._steps.labels(**self.values).inc()
        self._step.labels(**self.values).set(step)
        self._pending.labels(**self.values).set(0)

    def averaged(self, sent: int, received: int) -> None:
        self._avg_sent.labels(**self.values).inc(sent)
        self._avg_received.labels(**self.values).inc(received)

    def averaging_seconds(self, seconds: float) -> None:
        self._avg_seconds.labels(**self.values).observe(seconds)

    def queue(self, delta: int) -> None:
        self._queue.labels(**self.values).inc(delta)


class TrainerMetrics:
    def __init__(self, job: str, registry: CollectorRegistry | None = None) -> None:
        reg = self.registry = registry or CollectorRegistry()
        self.job, labels = job, list(_LABELS)
        self.microbatches = Counter(
            "swarm_trainer_microbatches_total", "Microbatches completed", ["job"], registry=reg
        ).labels(job=job)
        self.in_flight = Gauge(
            "swarm_trainer_microbatches_in_flight", "Microbatches in flight", ["job"], registry=reg
        ).labels(job=job)
        self._routed = Counter(
            "swarm_trainer_routed_total", "Hops routed to a replica", labels, registry=reg
        )
        self._throughput = Gauge(
            "swarm_trainer_replica_samples_per_second",
            "The trainer's throughput estimate of a replica (EMA)",
            labels,
            registry=reg,
        )
        self.cached_replays = Counter(
            "swarm_trainer_cached_replays_total",
            "Replays served from the trainer's cached boundary tensors (one hop, no pipeline)",
            ["job"],
            registry=reg,
        ).labels(job=job)
        self.unreported = Counter(
            "swarm_trainer_unreported_stages_total",
            "Stages a microbatch was reported without: the call there failed after it may have "
            "accumulated (the coordinator adopts the late receipt, or replays the stage)",
            ["job"],
            registry=reg,
        ).labels(job=job)
        self._failures = Counter(
            "swarm_trainer_hop_failures_total",
            "Hops that failed on a replica (retried on another)",
            labels,
            registry=reg,
        )

        self._stages: dict[str, set[str]] = {}  # peer -> the stage labels of its series

    def routed(self, stage: int, peer: str, throughput: float) -> None:
        self._stages.setdefault(peer, set()).add(str(stage))
        self._routed.labels(job=self.job, stage=str(stage), peer=peer).inc()
        self._throughput.labels(job=self.job, stage=str(stage), peer=peer).set(throughput)

    def failed(self, stage: int, peer: str) -> None:
        self._stages.setdefault(peer, set()).add(str(stage))
        self._failures.labels(job=self.job, stage=str(stage), peer=peer).inc()

    def forget(self, peer: str) -> None:
        """`peer` left the job: remove its series (a swarm's churn must not grow the registry)."""
        for stage in self._stages.pop(peer, ()):
            for family in (self._routed, self._throughput, self._failures):
                family.remove(self.job, stage, peer)  # absent: nothing to do


class CoordinatorFamilies:
    """The coordinator's series, created once per registry; `CoordinatorMetrics` binds a job."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["job"], registry=registry)

        self.replays = counter(
            "swarm_coordinator_replays_total",
            "Microbatch gradients lost at a stage and replayed there",
        )
        self.aborted_rounds = counter(
            "swarm_coordinator_aborted_rounds_total",
            "Averaging rounds of a stage that failed and repeated",
        )
        self.dropped = counter(
            "swarm_coordinator_dropped_replicas_total",
            "Replicas left out after they stopped answering",
        )
        self.rollbacks = counter(
            "swarm_coordinator_rollbacks_total", "Rollbacks of the whole job to its last checkpoint"
        )
        self.last_commit = Gauge(
            "swarm_coordinator_last_commit_timestamp_seconds",
            "Unix time of the last committed step (now - this = time since)",
            ["job"],
            registry=registry,
        )
        self.tokens = counter(
            "swarm_coordinator_tokens_total", "Tokens trained on in committed steps"
        )
        self.blocked = counter(
            "swarm_coordinator_blocked_seconds_total",
            "Seconds no microbatch could be leased because a step's commit was under way",
        )
        self.grad_norm = Gauge(
            "swarm_coordinator_grad_norm",
            "L2 norm of the whole model's averaged gradient at the last committed step, "
            "before clipping",
            ["job"],
            registry=registry,
        )
        self.val_loss = Gauge(
            "swarm_coordinator_val_loss",
            "Validation loss at the last evaluation (training.eval_every); NaN before the first",
            ["job"],
            registry=registry,
        )

    def remove(self, job: str) -> None:
        """`job` ended: remove its series."""
        for family in (
            self.replays,
            self.aborted_rounds,
            self.dropped,
            self.rollbacks,
            self.last_commit,
            self.tokens,
            self.blocked,
            self.grad_norm,
            self.val_loss,
        ):
            family.remove(job)  # absent: nothing to do


class CoordinatorMetrics:
    """What the step coordinator saw go wrong, and when it last committed."""

    def __init__(
        self,
        job: str,
        registry: CollectorRegistry | None = None,
        *,
        families: CoordinatorFamilies | None = None,
    ) -> None:
        f = families or CoordinatorFamilies(registry or CollectorRegistry())
        self.replays = f.replays.labels(job=job)
        self.aborted_rounds = f.aborted_rounds.labels(job=job)
        self.dropped = f.dropped.labels(job=job)
        self.rollbacks = f.rollbacks.labels(job=job)
        self.last_commit = f.last_commit.labels(job=job)
        self.grad_norm = f.grad_norm.labels(job=job)
        self.tokens = f.tokens.labels(job=job)
        self.blocked = f.blocked.labels(job=job)
        self.val_loss = f.val_loss.labels(job=job)
        self.val_loss.set(math.nan)
