"""The step coordinator's Prometheus series: the families one scheduler registers once, and
each job's view of them."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from swarm.ops.metrics import LATENCY_BUCKETS

__all__ = ["ROUND_BUCKETS", "CoordinatorFamilies", "CoordinatorMetrics", "RoundMetrics"]

# A round's averaging moves a whole stage's parameters: over slow links minutes, not milliseconds.
ROUND_BUCKETS = (*LATENCY_BUCKETS, 120, 300, 600)


class CoordinatorFamilies:
    """The coordinator's series, created once per registry; `CoordinatorMetrics` binds a job."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._progress(registry)
        self._recovery(registry)
        self._trust(registry)
        self._rounds(registry)

    def _progress(self, registry: CollectorRegistry) -> None:
        """How training goes: when a step last committed, what it trained on, what it waited
        for, its gradient and its validation loss."""
        self.last_commit = Gauge(
            "swarm_coordinator_last_commit_timestamp_seconds",
            "Unix time of the last committed step (now - this = time since)",
            ["job"],
            registry=registry,
        )
        self.tokens = _counter(
            registry, "swarm_coordinator_tokens_total", "Tokens trained on in committed steps"
        )
        self.blocked = _counter(
            registry,
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

    def _recovery(self, registry: CollectorRegistry) -> None:
        """What went wrong and was recovered from: work replayed, rounds repeated, replicas
        left out, the job rolled back; and what could not be (a non-finite gradient)."""
        self.replays = _counter(
            registry,
            "swarm_coordinator_replays_total",
            "Microbatch gradients lost at a stage and replayed there",
        )
        self.aborted_rounds = _counter(
            registry,
            "swarm_coordinator_aborted_rounds_total",
            "Averaging rounds of a stage that failed and repeated",
        )
        self.dropped = _counter(
            registry,
            "swarm_coordinator_dropped_replicas_total",
            "Replicas left out after they stopped answering",
        )
        self.refused = _counter(
            registry,
            "swarm_coordinator_refused_contributions_total",
            "Contributions to a stage's averaging past the norm bound, replayed on the others",
        )
        self.rollbacks = _counter(
            registry,
            "swarm_coordinator_rollbacks_total",
            "Rollbacks of the whole job to its last checkpoint",
        )
        self.nonfinite = Counter(
            "swarm_coordinator_nonfinite_gradients_total",
            "Steps a stage's averaged gradient was NaN or infinite in: nothing applied, job failed",
            ["job", "stage"],
            registry=registry,
        )
        self._nonfinite_stages: dict[str, set[str]] = {}  # job -> the stage labels it counted

    def _trust(self, registry: CollectorRegistry) -> None:
        """The audits: the peers they banned, and the compute they cost."""
        self.bans = _counter(
            registry,
            "swarm_coordinator_bans_total",
            "Peers banned from the job: an audit by re-execution caught them lying (issue 55)",
        )
        self.stage_runs = _counter(
            registry,
            "swarm_coordinator_stage_runs_total",
            "Stage computations of the microbatches trainers reported (either plane; on the push "
            "plane while it audits)",
        )
        self.audit_runs = _counter(
            registry,
            "swarm_coordinator_audit_runs_total",
            "Of those, re-executed on another replica for an audit: the audits' extra compute",
        )

    def _rounds(self, registry: CollectorRegistry) -> None:
        """A job whose pools meet in rounds (local, local-eager, step-eager) only
        (`RoundMetrics`): the round under way, each averaging's time and bytes, and the samples
        a replica that left a round trained on."""
        self.round = Gauge(
            "swarm_coordinator_round",
            'The round under way, from 1 (pool.mode = "local" or an eager rule\'s rounds)',
            ["job"],
            registry=registry,
        )
        self.round_seconds = Histogram(
            "swarm_coordinator_round_seconds",
            "Time of a round's averaging over every pool (its PREPARE and APPLY, or an eager "
            "rule's background sum)",
            ["job"],
            buckets=ROUND_BUCKETS,
            registry=registry,
        )
        self.round_bytes = _counter(
            registry,
            "swarm_coordinator_round_bytes_total",
            "Bytes the rounds' averaging moved between replicas, both ways, before compression "
            "(2 (N - 1) x a stage's parameter bytes per pool of N)",
        )
        self.round_dropped = _counter(
            registry,
            "swarm_coordinator_round_dropped_samples_total",
            'pool.mode = "local": samples a replica trained on in a round it left before the '
            "round's end (its local steps are not in the pool's average)",
        )

    def count_nonfinite(self, job: str, stage: int) -> None:
        self._nonfinite_stages.setdefault(job, set()).add(str(stage))
        self.nonfinite.labels(job=job, stage=str(stage)).inc()

    def remove(self, job: str) -> None:
        """`job` ended: remove its series."""
        for family in (
            self.replays,
            self.aborted_rounds,
            self.dropped,
            self.refused,
            self.rollbacks,
            self.bans,
            self.stage_runs,
            self.audit_runs,
            self.round_dropped,
            self.last_commit,
            self.tokens,
            self.blocked,
            self.grad_norm,
            self.val_loss,
            self.round,
            self.round_seconds,
            self.round_bytes,
        ):
            family.remove(job)  # absent: nothing to do
        for stage in self._nonfinite_stages.pop(job, ()):
            self.nonfinite.remove(job, stage)


class CoordinatorMetrics:
    """What the step coordinator saw go wrong, and when it last committed."""

    def __init__(
        self,
        job: str,
        registry: CollectorRegistry | None = None,
        *,
        families: CoordinatorFamilies | None = None,
    ) -> None:
        f = self._families = families or CoordinatorFamilies(registry or CollectorRegistry())
        self._job = job
        self.replays = f.replays.labels(job=job)
        self.aborted_rounds = f.aborted_rounds.labels(job=job)
        self.dropped = f.dropped.labels(job=job)
        self.refused = f.refused.labels(job=job)
        self.rollbacks = f.rollbacks.labels(job=job)
        self.bans = f.bans.labels(job=job)
        self.stage_runs = f.stage_runs.labels(job=job)
        self.audit_runs = f.audit_runs.labels(job=job)
        self.round_dropped = f.round_dropped.labels(job=job)
        self.last_commit = f.last_commit.labels(job=job)
        self.grad_norm = f.grad_norm.labels(job=job)
        self.tokens = f.tokens.labels(job=job)
        self.blocked = f.blocked.labels(job=job)
        self.val_loss = f.val_loss.labels(job=job)
        self.val_loss.set(math.nan)
        self._rounds: RoundMetrics | None = None

    def nonfinite(self, stage: int) -> None:
        """Stage `stage`'s averaged gradient was NaN or infinite at a step."""
        self._families.count_nonfinite(self._job, stage)

    def rounds(self) -> RoundMetrics:
        """The job's round series, created on the first call (a job with rounds makes it when
        its rounds are made; a job without has none)."""
        if self._rounds is None:
            self._rounds = RoundMetrics(self._families, self._job)
        return self._rounds


class RoundMetrics:
    """A job's rounds: the round under way, each averaging's time and bytes."""

    def __init__(self, families: CoordinatorFamilies, job: str) -> None:
        self.round = families.round.labels(job=job)
        self.seconds = families.round_seconds.labels(job=job)
        self.bytes = families.round_bytes.labels(job=job)


def _counter(registry: CollectorRegistry, name: str, doc: str) -> Counter:
    """A counter of the coordinator's, by job."""
    return Counter(name, doc, ["job"], registry=registry)
