"""What the coordinator's rounds (`round_strategy.rounds_of`: `rounds.PoolRounds`,
`eager_rounds.EagerRounds`) and its step's commit (`commit.TwoPhaseCommit`) share, as one value
built once by the coordinator: `RoundContext`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from scheduler.coordinator.groups import Groups
from scheduler.coordinator.membership import Membership
from scheduler.coordinator.metrics import CoordinatorMetrics
from scheduler.coordinator.replicas import ReplicaClients
from swarm.job.config import JobConfig
from swarm.job.rule import Rule
from swarm.model.routes import Record

__all__ = ["RoundContext"]


@dataclass(frozen=True)
class RoundContext:
    """The `job` and its `rule`; the connections to its replicas (`clients`), its members
    (`membership`) and its series (`metrics`); how a pool's round group is made (`groups`: its
    parts, its aggregators); `on_record`, the route record's sink (`swarm.model.routes`), and
    `on_status(text)`, what `swarm status` should say (a round that dropped a replica's
    samples)."""

    job: JobConfig
    rule: Rule
    clients: ReplicaClients
    membership: Membership
    metrics: CoordinatorMetrics
    groups: Groups = field(default_factory=Groups)
    on_record: Callable[[Record], None] | None = None
    on_status: Callable[[str], Awaitable[None] | None] | None = None
