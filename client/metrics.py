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
        self.window = Gauge(
            "swarm_trainer_window",
            "Microbatches the trainer keeps in flight at most: runtime.max_in_flight, or with "
            '"auto" what the stages\' activation caches hold (swarm.policy.window)',
            ["job"],
            registry=reg,
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
        # Audits by re-execution (issue 55, `client.audit.audits`): their price is
        # audit_runs / stage_runs, the compute they add to the training's own
        self.stage_runs = Counter(
            "swarm_trainer_stage_runs_total",
            "Stage computations (forward and backward) of the training microbatches completed",
            ["job"],
            registry=reg,
        ).labels(job=job)
        self.audit_runs = Counter(
            "swarm_trainer_audit_runs_total",
            "Stage computations re-executed on another replica for an audit (its extra compute)",
            ["job"],
            registry=reg,
        ).labels(job=job)
        self._audits = Counter(
            "swarm_trainer_audits_total",
            "Stages of microbatches audited, by outcome: agreed, caught (a liar found), "
            "undecided (no two answers agree, or no second auditor), skipped (no auditor "
            "answered), cut (a late audit past its bound), failed (a late audit's error)",
            ["job", "outcome"],
            registry=reg,
        )
        self.audit_difference = Gauge(
            "swarm_trainer_audit_max_difference",
            "The largest relative difference between two honest answers an audit accepted "
            "(0 where replicas compute bitwise alike, as on the CPU)",
            ["job"],
            registry=reg,
        ).labels(job=job)

        self._stages: dict[str, set[str]] = {}  # peer -> the stage labels of its series

    def audited(self, outcome: str) -> None:
        self._audits.labels(job=self.job, outcome=outcome).inc()

    def agreed(self, difference: float) -> None:
        self.audited("agreed")
        if difference > self.audit_difference._value.get():
            self.audit_difference.set(difference)

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
