"""The scheduler's side of the simulation: which stage each peer is assigned, decided by the calls
the scheduler makes (`place_new` for the initial and each joining peer, `Rebalancer.decide` every
period, `Rebalancer.refill` when a stage loses its last replica), with the peers' failure domains
where they have some, and the optimum to judge them by (`place`)."""

from __future__ import annotations

from swarm.job.config import RebalanceConfig
from swarm.policy.domains import Domains
from swarm.policy.placement import bottleneck, place, place_new
from swarm.policy.rebalance import Move, Rebalancer

__all__ = ["Registry"]

# Effort of `place` for the optimum. Measured on the default mix: at 100 peers x 8 stages more
# rounds raise its bottleneck by under 0.3% at 5x the cost; at 1,000 peers a tenth of the default
# budget finds the same bottleneck at under half the cost (0.16 s).
_OPTIMUM_ROUNDS = 10
_OPTIMUM_BUDGET = 200_000


class Registry:
    def __init__(self, stages: int, rebalance: RebalanceConfig, min_replicas: int = 1) -> None:
        self.stages, self.min_replicas = stages, min_replicas
        self.assignment: dict[str, int] = {}  # present peers -> the stage they are assigned
        self.speeds: dict[str, list[float]] = {}  # present peers -> samples/s on each stage
        self.domains: dict[str, Domains] = {}  # present peers -> their host and router, if any
        self.rebalancer = Rebalancer(rebalance, min_replicas)
        self._totals = [0.0] * stages  # assigned samples/s per stage, kept up to date
        self._sizes = [0] * stages  # assigned peers per stage
        self.counted: set[str] = set()  # peers the optimum is for: present, done joining
        self.strength = 0.0  # sum of `_strength` over them
        self._per_strength = 0.0  # the last evaluated optimum / strength

    def add(self, peer: str, speeds: list[float], domains: Domains | None = None) -> None:
        self.speeds[peer] = speeds
        if domains is not None:
            self.domains[peer] = domains

    def assign(self, peer: str, stage: int) -> None:
        old = self.assignment.get(peer)
        row = self.speeds[peer]
        if old is not None:
            self._totals[old] -= row[old]
            self._sizes[old] -= 1
        self.assignment[peer] = stage
        self._totals[stage] += row[stage]
        self._sizes[stage] += 1

    def count(self, peer: str) -> None:
        """`peer` finished joining: the optimum is for it too from now on."""
        self.counted.add(peer)
        self.strength += _strength(self.speeds[peer])

    def remove(self, peer: str) -> None:
        if peer in self.counted:
            self.counted.remove(peer)
            self.strength -= _strength(self.speeds[peer])
        stage = self.assignment.pop(peer, None)
        if stage is not None:
            self._totals[stage] -= self.speeds[peer][stage]
            self._sizes[stage] -= 1
        self.speeds.pop(peer, None)
        self.domains.pop(peer, None)
        self.rebalancer.forget(peer)

    def place_all(self) -> dict[str, int]:
        """Every peer known, nothing serving yet: the initial placement."""
        floor, domains = self.min_replicas, self.domains
        return place_new(self.speeds, self.stages, min_replicas=floor, domains=domains)

    def join_stage(self, peer: str) -> int:
        """The stage for a joining peer, on the assigned totals (peers still downloading
        included, so a burst of joins does not all go to one stage)."""
        row = {peer: self.speeds[peer]}
        sizes, floor = self._sizes, self.min_replicas
        there: list[list[str]] = [[] for _ in range(self.stages)]
        for other, stage in self.assignment.items():
            there[stage].append(other)
        return place_new(
            row,
            self.stages,
            self._totals,
            min_replicas=floor,
            sizes=sizes,
            domains=self.domains,
            members=there,
        )[peer]

    def plan(self, now: float) -> Move | None:
        move = self.rebalancer.decide(self.assignment, self.speeds, self.stages, now, self.domains)
        if move is not None:
            self.assign(move.peer, move.dst)
        return move

    def refill(self, now: float) -> list[Move]:
        """Spare replicas moved at once to stages nobody is assigned (a stalled job)."""
        moves = self.rebalancer.refill(self.assignment, self.speeds, self.stages, now, self.domains)
        for move in moves:
            self.assign(move.peer, move.dst)
        return moves

    def optimum_now(self) -> float:
        """The optimum between evaluations: the last one, scaled by the change in strength."""
        return self.strength * self._per_strength

    def evaluate_optimum(self) -> float:
        """The best bottleneck known for the counted peers: `place`'s, or the current one if
        higher (`place` is a heuristic)."""
        speeds = {p: self.speeds[p] for p in sorted(self.counted)}
        # Resum the running sums now and then: many += and -= drift.
        self.strength = sum(_strength(row) for row in speeds.values())
        self._totals = [0.0] * self.stages
        for peer, stage in self.assignment.items():
            self._totals[stage] += self.speeds[peer][stage]
        if not speeds:
            return 0.0
        now = {p: self.assignment[p] for p in speeds}
        plan = place(speeds, self.stages, rounds=_OPTIMUM_ROUNDS, budget=_OPTIMUM_BUDGET)
        best = max(bottleneck(plan, speeds, self.stages), bottleneck(now, speeds, self.stages))
        self._per_strength = best / self.strength if self.strength > 0.0 else 0.0
        return best


def _strength(row: list[float]) -> float:
    """What a peer adds to the optimum, to first order: 1 / sum_k 1/speed_k. Spread over the
    stages in proportion to its speeds it adds that much to every stage's total; for peers whose
    speeds are proportional from stage to stage the sum of these is the bottleneck of the best
    fractional placement, exactly."""
    return 1.0 / sum(1.0 / s for s in row if s > 0.0)
