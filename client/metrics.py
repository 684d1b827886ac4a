"""A trainer's Prometheus series (served by `swarm.ops.metrics.serve_metrics`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from swarm.ops.metrics import LABELS

__all__ = ["TrainerMetrics"]


class TrainerMetrics:
    def __init__(self, job: str, registry: CollectorRegistry | None = None) -> None:
        reg = self.registry = registry or CollectorRegistry()
        self.job, labels = job, list(LABELS)
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
