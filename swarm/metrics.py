"""Prometheus metrics. Each process builds its metrics on its own `CollectorRegistry` (so tests can
run many servers in one process) and serves it on `/metrics`.

Labels are job, stage and peer, plus `method` on per-RPC series: a bounded set of RPC names,
which is how Prometheus expects per-method latency to be split (see docs/metrics.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["StageMetrics", "TrainerMetrics", "serve_metrics"]

log = logging.getLogger(__name__)

# Hop latencies range from a millisecond (tiny stages) to tens of seconds (big stages on slow
# devices); exponential buckets cover that.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve `/metrics` on a daemon thread; returns the bound port (useful when `port` is 0)."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    bound = int(server.server_address[1])
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound


@dataclass
class StageMetrics:
    registry: CollectorRegistry
    labels: dict[str, str]
    requests: Counter  # labelled further by method and code
    latency: Histogram  # labelled further by method
    samples: Counter
    wire_bytes_received: Counter
    raw_bytes_received: Counter
    wire_bytes_sent: Counter
    raw_bytes_sent: Counter
    optimizer_steps: Counter
    queue_depth: Gauge
    pending_receipts: Gauge
    step: Gauge

    @classmethod
    def create(cls, job: str, stage: int, peer: str) -> StageMetrics:
        reg = CollectorRegistry()
        labels = {"job": job, "stage": str(stage), "peer": peer}
        names = list(labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=reg).labels(**labels)

        return cls(
            registry=reg,
            labels=labels,
            requests=Counter(
                "swarm_stage_requests_total",
                "RPCs handled, by method and status code",
                [*names, "method", "code"],
                registry=reg,
            ),
            latency=Histogram(
                "swarm_stage_request_seconds",
                "RPC handling time by method",
                [*names, "method"],
                buckets=_LATENCY_BUCKETS,
                registry=reg,
            ),
            samples=counter("swarm_stage_samples_total", "Samples passed through Backward"),
            wire_bytes_received=counter(
                "swarm_stage_wire_bytes_received_total",
                "Tensor bytes received, as encoded on the wire",
            ),
            raw_bytes_received=counter(
                "swarm_stage_raw_bytes_received_total",
                "Tensor bytes received, decoded (before compression)",
            ),
            wire_bytes_sent=counter(
                "swarm_stage_wire_bytes_sent_total", "Tensor bytes sent, as encoded on the wire"
            ),
            raw_bytes_sent=counter(
                "swarm_stage_raw_bytes_sent_total", "Tensor bytes sent, before compression"
            ),
            optimizer_steps=counter("swarm_stage_optimizer_steps_total", "Optimizer steps applied"),
            queue_depth=Gauge(
                "swarm_stage_queue_depth",
                "Compute requests waiting or running",
                names,
                registry=reg,
            ).labels(**labels),
            pending_receipts=Gauge(
                "swarm_stage_pending_receipts",
                "Microbatches accumulated for the current step",
                names,
                registry=reg,
            ).labels(**labels),
            step=Gauge(
                "swarm_stage_step", "Steps committed on this replica", names, registry=reg
            ).labels(**labels),
        )

    def observe(self, method: str, code: str, seconds: float) -> None:
        self.requests.labels(**self.labels, method=method, code=code).inc()
        self.latency.labels(**self.labels, method=method).observe(seconds)


@dataclass
class TrainerMetrics:
    registry: CollectorRegistry
    microbatches: Counter
    samples: Counter
    in_flight: Gauge
    step: Gauge
    loss: Gauge
    step_seconds: Histogram

    @classmethod
    def create(cls, job: str) -> TrainerMetrics:
        reg = CollectorRegistry()
        return cls(
            registry=reg,
            microbatches=Counter(
                "swarm_trainer_microbatches_total", "Microbatches completed", ["job"], registry=reg
            ).labels(job=job),
            samples=Counter(
                "swarm_trainer_samples_total", "Samples trained", ["job"], registry=reg
            ).labels(job=job),
            in_flight=Gauge(
                "swarm_trainer_microbatches_in_flight",
                "Microbatches in flight",
                ["job"],
                registry=reg,
            ).labels(job=job),
            step=Gauge("swarm_job_step", "Last committed step", ["job"], registry=reg).labels(
                job=job
            ),
            loss=Gauge(
                "swarm_job_loss", "Loss of the last committed step", ["job"], registry=reg
            ).labels(job=job),
            step_seconds=Histogram(
                "swarm_trainer_step_seconds",
                "Wall time per step",
                ["job"],
                buckets=_LATENCY_BUCKETS,
                registry=reg,
            ).labels(job=job),
        )
