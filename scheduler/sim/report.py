"""What a simulated run reports: throughput per window against two references.

Throughput is the samples/s the bottleneck stage (the one with the least capacity over the window,
see `current`) computed in the window, a hop's work credited to the windows it ran in. Each task
visits every stage once per trip, so in the long run that is the samples/s of finished microbatches
(`completed_per_s`; the two differ by at most the tasks in flight over the run). Per window they do
not: a coarse task spends an hour or more in a 1,000-peer pipeline (Little's law: tasks in flight
over tasks per second), so finished tasks per window measure that delay, and other stages compute
in bursts as the queues in front of them fill and drain. The bottleneck stage, busy whenever the
pipeline keeps it fed, is what the swarm's throughput is. Work lost in a crash is not credited
(unless a window closed while it ran).

- `optimum`: the bottleneck of the best placement known for the peers present at that moment
  (those that finished their first download): `swarm.policy.placement.place` on them, or the current
  placement if that is better (`place` is a heuristic). `place` costs ~0.2 s at 1,000 peers, so it
  runs every `optimum_every_s`; in between, each join and departure scales the last value by the
  peers' combined strength, sum_p 1 / sum_k 1/speed_pk (exact for a fluid placement of peers whose
  speeds are proportional across stages; measured against `place` after 15 minutes of churn at a
  one-hour mean lifetime: within 0.1% at 1,000 peers, 1% at 100). When the current placement did
  better over the window (below), that is the optimum instead. A bad placement is penalised
  against it: **`ratio` uses this one.**
- `current`: the bottleneck stage's total capacity (docs/architecture.md, "Policies") where the
  replicas are: the smallest over stages of the time-mean samples/s of the replicas computing there
  (exact integrals). Queues carry work across a short dip of one stage, hence the mean before the
  minimum; a stage cannot compute more than it has, so throughput never exceeds this. It falls short
  of it through the pipeline itself: queues, crashes losing the hop in service, network. A move's
  drain and download count against it as soon as the peer stops computing."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Summary", "Window"]


@dataclass(frozen=True)
class Window:
    start_s: float
    end_s: float
    samples_per_s: float
    """Samples the bottleneck stage computed in the window (forward and backward), per second."""
    completed_per_s: float
    """Samples whose last backward returned in the window, per second."""
    optimum: float
    """Time-mean of `place`'s bottleneck for the peers present, samples/s."""
    current: float
    """Time-mean of the serving replicas' bottleneck where they are, samples/s."""
    peers: int
    """Peers present at the window's end (downloading ones included)."""
    joins: int
    departures: int
    moves: int

    @property
    def ratio(self) -> float:
        return self.samples_per_s / self.optimum if self.optimum > 0.0 else 0.0


@dataclass(frozen=True)
class Summary:
    policy: str
    peers: int
    stages: int
    hours: float
    seed: int
    windows: list[Window]
    joins: int
    departures: int
    moves: int
    failed_hops: int
    """Hops that failed because their replica left; each is retried elsewhere."""
    events: int
    wall_s: float = field(compare=False)
    """Seconds the run took here (not part of equality: the rest is a function of the config)."""

    @property
    def mean_ratio(self) -> float:
        """Samples done over the samples the optimum would have done, whole run."""
        done = sum(w.samples_per_s * (w.end_s - w.start_s) for w in self.windows)
        best = sum(w.optimum * (w.end_s - w.start_s) for w in self.windows)
        return done / best if best > 0.0 else 0.0

    @property
    def mean_ratio_current(self) -> float:
        """Samples done over what the current placement could have done, whole run."""
        done = sum(w.samples_per_s * (w.end_s - w.start_s) for w in self.windows)
        cap = sum(w.current * (w.end_s - w.start_s) for w in self.windows)
        return done / cap if cap > 0.0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["windows"] = [asdict(w) | {"ratio": w.ratio} for w in self.windows]
        out["mean_ratio"] = self.mean_ratio
        out["mean_ratio_current"] = self.mean_ratio_current
        return out
