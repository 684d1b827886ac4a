"""What the simulator simulates: its configuration, and the peers and microbatches it moves around.

The unit of work is a *task*: `task_samples` samples that travel together through the pipeline, as
one microbatch does, but far coarser (a T4-like peer spends `hop_s` = 3 minutes on one at a stage
of cost 1), so that 24 hours of 1,000 peers take about two million events. A task visits stages
0..S-2 forward, S-1 forward+loss+backward in one call, and S-2..0 backward: 2S-1 hops. Each hop
waits in the replica's FIFO queue (one task at a time), then takes `work * task_samples / speed`
seconds, `speed` being the peer's samples/s on that stage (forward and backward of a sample) and
`work` the hop's share (`forward_share`, its complement, or 1 on the last stage). When the last
backward returns the trainer starts a new task, so each keeps a constant number in flight. A peer
that crashes loses the hop it was computing; that hop and those queued there are retried
elsewhere. The coarseness shows in that loss (half a hop per crash: ~1.6% of the throughput at a
one-hour mean lifetime) and in the hours a task spends in the pipeline (see `report`).

Not modelled: optimizer steps and pool averaging (the pipeline never waits for a step boundary),
the replays of gradients a crashed replica held, trainer failures, bandwidth (a hop costs its
peer's latency both ways, nothing per byte), and load reports when there is a single trainer (it
sees every queue exactly through its own `started`/`finished`).
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from swarm.errors import ConfigError
from swarm.job.config import RebalanceConfig
from swarm.policy.wiring import WiringConfig

__all__ = [
    "SEED_PREFIX",
    "PeerState",
    "SimClock",
    "SimConfig",
    "SimPeer",
    "SimTask",
    "class_affinity",
    "hop_stage",
    "hop_work",
    "new_peer",
]

# The random streams are named from this, as they were when the simulator lived in `swarm.sim`:
# a moved module must not change what `swarm simulate --seed N` gives (docs quote its figures).
SEED_PREFIX = "swarm.sim"
Policy = Literal["none", "swarm"]
#: (name, speed relative to the slowest class, share of peers)
SpeedClass = tuple[str, float, float]
DEFAULT_CLASSES: tuple[SpeedClass, ...] = (("T4", 1.0, 0.5), ("V100", 2.5, 0.3), ("A100", 6.0, 0.2))


@dataclass(frozen=True)
class SimConfig:
    """One simulated run; every field is validated by `__post_init__`."""

    peers: int = 100
    """Peers at the start; each serves the stage `place` gives it (see `skew`)."""
    stages: int = 8
    hours: float = 1.0
    """Simulated time, hours."""
    seed: int = 0
    policy: Policy = "swarm"
    """`swarm`: rebalance every `rebalance.period_s`; `none`: never."""
    speed_classes: tuple[SpeedClass, ...] = DEFAULT_CLASSES
    peer_jitter: float = 0.1
    """Sigma of a log-normal factor on each peer's speed (host, clocks, cooling): the same on every
    stage."""
    class_stage_jitter: float = 0.05
    """Sigma of a log-normal factor per (class, stage), drawn once per seed: some hardware suits
    some stages better (memory- or compute-bound), which is what placement can exploit."""
    stage_costs: tuple[float, ...] | None = None
    """Relative compute per sample of each stage; None: 1.2 for the first (embedding), 1.5 for the
    last (head and loss), 1 between."""
    stage_sizes: tuple[float, ...] | None = None
    """Relative state size of each stage, for downloads; None: the costs."""
    hop_s: float = 180.0
    """Seconds the slowest class takes for one task's forward+backward on a stage of cost 1: the
    task granularity. Coarser is faster to simulate; a crash loses the hop in service."""
    task_samples: float = 1024.0
    """Samples per task: scales samples/s, nothing else."""
    forward_share: float = 1.0 / 3.0
    """Share of a stage's per-sample compute spent in the forward."""
    latency_s: float = 0.05
    """Mean one-way network latency, seconds; each peer draws its own from [0.5, 1.5] x this."""
    lifetime_h: float = 0.0
    """Mean peer lifetime, hours (exponential; a departure is a crash); 0: peers never leave."""
    join_rate_h: float | None = None
    """Peer joins per hour (Poisson); None: peers / lifetime_h, which keeps the pool about
    constant (0 without churn)."""
    download_s: float = 60.0
    """Seconds a joining or moved peer spends downloading the state of a stage of size 1."""
    trainers: int = 1
    inflight_per_peer: float = 4.0
    """Tasks in flight over all trainers, per initial peer (enough to keep the bottleneck busy)."""
    load_report_s: float = 30.0
    """Seconds between the load reports peers send to trainers (only with several trainers)."""
    retry_s: float = 5.0
    """Seconds a trainer waits when a stage has no eligible replica."""
    window_s: float = 3600.0
    """Length of a reporting window, seconds."""
    optimum_every_s: float | None = None
    """Seconds between evaluations of the optimum (`place` on the current peers, costly; see
    `report`); None: once per window."""
    min_replicas: int = 1
    """Replicas every stage gets before any gets more, and keeps under rebalancing (a job's
    `runtime.min_replicas`)."""
    hosts: int = 0
    """Machines the peers run on, each peer on one drawn at random, two machines behind each
    router (their failure domains, `swarm.policy.domains`: placement spreads a stage's replicas
    over them); 0: every peer on a machine and router of its own (nothing to spread)."""
    skew: float = 0.0
    """Share [0, 1) of stage 0's peers that start on the other stages instead (a scenario that
    needs rebalancing)."""
    rebalance: RebalanceConfig | None = None
    """None: the defaults, with move_cost_s = the largest stage's download."""
    wiring: WiringConfig | None = None

    def __post_init__(self) -> None:
        _check(self.peers >= 1, "peers", self.peers, "at least one peer")
        _check(self.stages >= 1, "stages", self.stages, "at least one stage")
        _check(self.trainers >= 1, "trainers", self.trainers, "at least one trainer")
        _check(self.policy in ("none", "swarm"), "policy", self.policy, "none or swarm")
        for name in (
            "hours",
            "hop_s",
            "task_samples",
            "window_s",
            "retry_s",
            "load_report_s",
            "inflight_per_peer",
        ):
            value = getattr(self, name)
            _check(math.isfinite(value) and value > 0.0, name, value, "a positive number")
        for name in ("peer_jitter", "class_stage_jitter", "latency_s", "lifetime_h", "download_s"):
            value = getattr(self, name)
            _check(math.isfinite(value) and value >= 0.0, name, value, "a number >= 0")
        _check(0.0 < self.forward_share < 1.0, "forward_share", self.forward_share, "in (0, 1)")
        _check(0.0 <= self.skew < 1.0, "skew", self.skew, "a share in [0, 1)")
        _check(self.min_replicas >= 1, "min_replicas", self.min_replicas, "an integer >= 1")
        _check(self.hosts >= 0, "hosts", self.hosts, "an integer >= 0")
        if self.join_rate_h is not None:
            ok = math.isfinite(self.join_rate_h) and self.join_rate_h >= 0.0
            _check(ok, "join_rate_h", self.join_rate_h, "joins per hour >= 0")
        if self.optimum_every_s is not None:
            ok = math.isfinite(self.optimum_every_s) and self.optimum_every_s > 0.0
            _check(ok, "optimum_every_s", self.optimum_every_s, "positive seconds")
        _check(
            bool(self.speed_classes) and all(s > 0 and w > 0 for _, s, w in self.speed_classes),
            "speed_classes",
            self.speed_classes,
            "(name, speed > 0, share > 0) entries",
        )
        for name in ("stage_costs", "stage_sizes"):
            value = getattr(self, name)
            ok = value is None or (
                len(value) == self.stages and all(math.isfinite(v) and v > 0 for v in value)
            )
            _check(ok, name, value, f"{self.stages} positive numbers, one per stage")

    @property
    def costs(self) -> tuple[float, ...]:
        if self.stage_costs is not None:
            return self.stage_costs
        costs = [1.0] * self.stages
        costs[0] = 1.2
        costs[-1] = 1.5
        return tuple(costs)

    @property
    def sizes(self) -> tuple[float, ...]:
        return self.stage_sizes if self.stage_sizes is not None else self.costs

    @property
    def joins_per_hour(self) -> float:
        if self.join_rate_h is not None:
            return self.join_rate_h
        return self.peers / self.lifetime_h if self.lifetime_h > 0.0 else 0.0

    @property
    def rebalance_config(self) -> RebalanceConfig:
        if self.rebalance is not None:
            return self.rebalance
        return RebalanceConfig(move_cost_s=self.download_s * max(self.sizes))


def _check(ok: bool, name: str, value: object, want: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r}: use {want}")


class SimClock:
    """The `swarm.policy.wiring.Clock` of the simulation: the time of the event being handled."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


class PeerState:
    DOWNLOADING = 0  # fetching a stage's state (joining or moved): serves nothing
    SERVING = 1
    DRAINING = 2  # ordered to move: finishes its queue, takes no new work
    GONE = 3


@dataclass(slots=True, eq=False)
class SimTask:
    trainer: int
    hop: int = 0
    ready: float = 0.0  # when it reaches the replica (after the network)
    started: float = 0.0  # when the replica began computing it


@dataclass(slots=True, eq=False)
class SimPeer:
    name: str
    speeds: list[float]  # samples/s on each stage
    latency: float  # one-way seconds
    stage: int  # the stage it is assigned: serves, is downloading for, or is draining towards
    at: int = -1  # the stage it computes for now (serving or draining), -1 while downloading
    state: int = PeerState.DOWNLOADING
    fresh: bool = True  # still in its first download: not yet part of the optimum
    busy: SimTask | None = None
    queue: deque[SimTask] = field(default_factory=deque)
    epoch: int = 0  # bumped to void this peer's scheduled events


def hop_stage(hop: int, stages: int) -> int:
    """Stage of hop `hop`: forward 0..S-1 (the last one fused with the backward), then back."""
    return hop if hop < stages else 2 * stages - 2 - hop


def hop_work(hop: int, stages: int, forward_share: float) -> float:
    """Share of a stage's per-sample compute done in hop `hop`."""
    if hop == stages - 1:
        return 1.0
    return forward_share if hop < stages else 1.0 - forward_share


def class_affinity(config: SimConfig) -> list[list[float]]:
    """Each class's speed factor on each stage, a function of the seed."""
    rng = random.Random(f"{SEED_PREFIX}/{config.seed}/classes")
    sigma = config.class_stage_jitter
    return [[rng.lognormvariate(0.0, sigma) for _ in config.costs] for _ in config.speed_classes]


def new_peer(
    rng: random.Random, name: str, config: SimConfig, affinity: list[list[float]]
) -> tuple[SimPeer, float]:
    """A peer drawn from the speed mix, and its lifetime in seconds (inf without churn). It draws
    the same numbers whatever the policy, so runs that differ only in policy see the same peers
    come and go (common random numbers: their difference is the policy's, not the dice's)."""
    classes = config.speed_classes
    kind = rng.choices(range(len(classes)), weights=[w for _, _, w in classes])[0]
    unit = config.task_samples / config.hop_s  # samples/s of the slowest class on a cost-1 stage
    power = classes[kind][1] * unit * rng.lognormvariate(0.0, config.peer_jitter)
    speeds = [power * a / cost for a, cost in zip(affinity[kind], config.costs, strict=True)]
    latency = config.latency_s * rng.uniform(0.5, 1.5)
    lifetime = (
        rng.expovariate(1.0 / (config.lifetime_h * 3600.0)) if config.lifetime_h > 0 else math.inf
    )
    return SimPeer(name=name, speeds=speeds, latency=latency, stage=0), lifetime
