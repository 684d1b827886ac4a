"""Rebalancing: which one peer, if any, the scheduler moves to the bottleneck stage now.

Pure policy over plain data (docs/architecture.md, "Policies"), run every `period_s` by the
scheduler and by the simulator, both through `Rebalancer` (the decision and the memory of past moves
it needs). Its tuning is the job file's `[rebalance]` section, `swarm.job.schema.RebalanceConfig`.
The job runs at its bottleneck `min_k total_k`, the smallest summed samples/s of a stage's replicas;
`speeds[peer][k]` is already in samples/s of stage k, so totals of stages of different cost compare
directly (every sample passes every stage: each stage needs the same rate).

`plan_refill` is the other decision, taken at once when a stage has lost its last replica (the job
stalls: no microbatch crosses it): which spare replica to move there (below).

A decision looks at moving one peer into the bottleneck stage `b`, from the most over-served stage
(highest total) first; only when no peer there passes every check are the other stages tried, in
decreasing order of total (a fast peer on a less over-served stage may help where the slow peers of
the most over-served one cannot). Among the peers of the first stage that has a valid candidate it
takes the one that makes the new bottleneck `after` largest. A candidate is valid when:
- the move leaves its stage with a replica (never empty a stage), and with at least
  `min_replicas` (the job's `runtime.min_replicas`: redundancy is not traded for throughput), and
  can serve `b` (speed > 0);
- hysteresis: `after > before * hysteresis`. A move that only reshuffles float error or measurement
  noise is not worth a peer's downtime, and the reverse move is never attractive right after.
  Except when the swarm is out of balance, `before * hysteresis < mean`, the mean being that of the
  stage totals: then any gain (`after > before`) will do. That holds when one peer is a small
  share of a stage (see "Scale"). Out of balance, a stage tied with `b` (`after` cannot rise in
  one move) does not block: the move is valid when it leaves `b` and the source both above
  `before`, and the tied stage is lifted by the next move; `after` is then `before`;
- dwell: the peer has not moved within `min_dwell_s`, nor has its stage *received* a peer within
  `min_dwell_s`. The second part stops the A->B, B->A flip-flop done by two different peers, and
  covers the first (a peer that just moved sits on the stage it joined), so a peer never moves
  back to the stage it left within `min_dwell_s`: it does not move at all;
- cost: the moved peer is offline for `move_cost_s` (drain, download the stage's state), which costs
  the job at most the peer's own rate at its source, `speeds[peer][src] * move_cost_s` samples. The
  gain arrives after the download and lasts about `horizon_s` (the time the new placement is
  expected to hold: peers come and go), so the move must satisfy
      (lifted - before) * (horizon_s - move_cost_s) > speeds[peer][src] * move_cost_s,
  `lifted` being the smaller of the source's and `b`'s totals after the move (`after` but for a
  tie).
Ties between candidates: the higher `after`, then the higher minimum of the source and `b` after
the move, then (given the peers' failure domains, `swarm.policy.domains`) the move that spreads
the two stages' replicas over more hosts, then routers, then the smaller rate given up at the
source, then the higher rate gained at `b`, then the peer id; stages tie to the lower index. So
the output is a function of the input.

Scale. Applied to one move, the hysteresis compares one peer's effect with a whole stage's: with
P/S peers per stage one move lifts the bottleneck by about S/P of it, so a factor of 1.1 alone
would act only in swarms of up to ~10 peers per stage. Measured in the simulator (1,000 peers, 8
stages, no churn, stage 0 started 30% short, factor 1.05) that rule stayed at 0.59 of the optimum
for good. Hence the second test, on the imbalance: the bottleneck against the mean of the stage
totals. Each move then has to lift the bottleneck at all, and pay for its download (the cost check,
which compares the gain with the moved peer's own rate). That rule stops once the stages are within
the factor of their mean: the same swarm reaches 0.957 of the optimum within an hour (19 moves;
0.997 with a factor of 1.0, 27 moves). Fixed speeds cannot make it cycle: each move strictly raises
the sorted stage totals (lexicographically: the bottleneck rises, or one fewer stage sits at it).
Drifting speeds are handled by the dwell. In small swarms one move is a large step and both rules
agree.

Cost: O(P) per decision (one pass to sum and group, one over the candidate stages' peers).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from swarm.job.config import RebalanceConfig
from swarm.policy.domains import Domains, move_crowding

# RebalanceConfig's home is the job file's config (`swarm.job.config`); it is named here too because
# the policy takes it.
__all__ = ["Move", "RebalanceConfig", "Rebalancer", "plan_move", "plan_refill"]

# Totals are float sums taken in different orders: a gain within this is no gain.
_REL_TOL = 1e-9


@dataclass(frozen=True, slots=True)
class Move:
    """Move `peer` from stage `src` to stage `dst`; the bottleneck goes from `before` to `after`
    (samples/s) once it serves there (equal when another stage tied with `dst`)."""

    peer: str
    src: int
    dst: int
    before: float
    after: float


def plan_move(
    assignment: Mapping[str, int],
    speeds: Mapping[str, Sequence[float]],
    num_stages: int,
    *,
    now: float,
    last_moved: Mapping[str, float],
    config: RebalanceConfig | None = None,
    min_replicas: int = 1,
    domains: Mapping[str, Domains] | None = None,
) -> Move | None:
    """The move to order now, or None. `assignment` maps each peer to the stage it serves or is
    moving to, `speeds[peer][k]` is its measured samples/s on stage k, `last_moved[peer]` the
    clock time of its last move (absent: never moved); no move leaves its stage with fewer than
    `min_replicas` replicas (nor with none); `domains`: the peers' failure domains (a
    tie-breaker)."""
    config = config or RebalanceConfig()
    if num_stages < 2:
        return None  # nowhere to move to
    totals, members = _stages(assignment, speeds, num_stages)
    keep = max(1, min_replicas)  # replicas a source stage keeps
    dst = min(range(num_stages), key=lambda k: (totals[k], k))
    before = totals[dst]
    out_of_balance = before * config.hysteresis < sum(totals) / num_stages
    floor = before * (1.0 if out_of_balance else config.hysteresis) * (1.0 + _REL_TOL)
    dwell = config.min_dwell_s
    received = {assignment[p] for p, t in last_moved.items() if p in assignment and now - t < dwell}
    for src in sorted(range(num_stages), key=lambda k: (-totals[k], k)):
        if src == dst or len(members[src]) <= keep or src in received:
            continue
        move = _best_from(
            src,
            dst,
            members,
            totals,
            speeds,
            before,
            floor,
            out_of_balance,
            now,
            last_moved,
            config,
            domains,
        )
        if move is not None:
            return move
    return None


def plan_refill(
    assignment: Mapping[str, int],
    speeds: Mapping[str, Sequence[float]],
    num_stages: int,
    *,
    min_replicas: int = 1,
    domains: Mapping[str, Domains] | None = None,
) -> list[Move]:
    """The moves that serve stages nobody serves (a stalled job), at once: no hysteresis, cost or
    dwell check, as nothing trains until every stage is served. For each empty stage (lowest
    first) a spare replica moves there: one of a stage with more than `min_replicas` replicas,
    else (a stall is worse than thinner redundancy) of a stage with at least two, never a stage's
    last. Among those it takes the move that leaves the highest bottleneck, then the one that
    spreads the source's replicas over more hosts, then routers (`domains`), then the peer
    fastest at the empty stage, then the one slowest where it is, then the peer id. A stage no
    spare can serve (speed 0) stays empty: starting a stage server is the remedy then.
    Arguments as for `plan_move`; `speeds` may be announced rather than measured figures."""
    totals, members = _stages(assignment, speeds, num_stages)
    keep = max(1, min_replicas)
    moves: list[Move] = []
    for dst in [k for k in range(num_stages) if not members[k]]:
        # (spare tier, -bottleneck after, crowding, -speed at dst, speed lost at src, peer)
        best: tuple[int, float, tuple[int, int], float, float, str] | None = None
        src_of: dict[str, int] = {}
        for src, peers in enumerate(members):
            if len(peers) < 2:
                continue
            tier = 0 if len(peers) > keep else 1
            for peer in peers:
                row = speeds[peer]
                if row[dst] <= 0.0:
                    continue
                after = min(
                    min((t for k, t in enumerate(totals) if k not in (src, dst)), default=math.inf),
                    totals[src] - row[src],
                    row[dst],
                )
                crowd = move_crowding(peer, peers, members[dst], domains)
                key = (tier, -after, crowd, -row[dst], row[src], peer)
                if best is None or key < best:
                    best, src_of[peer] = key, src
        if best is None:
            continue
        peer = best[-1]
        src = src_of[peer]
        moves.append(Move(peer=peer, src=src, dst=dst, before=0.0, after=-best[1]))
        members[src].remove(peer)
        members[dst].append(peer)
        totals[src] -= speeds[peer][src]
        totals[dst] += speeds[peer][dst]
    return moves


def _stages(
    assignment: Mapping[str, int], speeds: Mapping[str, Sequence[float]], num_stages: int
) -> tuple[list[float], list[list[str]]]:
    """Each stage's summed samples/s and its peers (in `assignment`'s order), checked."""
    totals = [0.0] * num_stages
    members: list[list[str]] = [[] for _ in range(num_stages)]
    for peer, stage in assignment.items():
        if not 0 <= stage < num_stages:
            raise ValueError(f"peer {peer!r}: stage {stage} out of range 0..{num_stages - 1}")
        row = speeds[peer]
        if len(row) != num_stages:
            raise ValueError(f"peer {peer!r}: {len(row)} speeds for {num_stages} stages")
        totals[stage] += row[stage]
        members[stage].append(peer)
    return totals, members


def _best_from(
    src: int,
    dst: int,
    members: list[list[str]],
    totals: list[float],
    speeds: Mapping[str, Sequence[float]],
    before: float,
    floor: float,
    out_of_balance: bool,
    now: float,
    last_moved: Mapping[str, float],
    config: RebalanceConfig,
    domains: Mapping[str, Domains] | None,
) -> Move | None:
    """The best valid move of one of `src`'s `members` to `dst`, or None. Valid: it lifts
    `src` and `dst` both above `floor`, and so the bottleneck, unless another stage ties with
    `dst`: then only out of balance, where lifting the tied stages one by one is the way up."""
    # Stages other than src and dst keep their totals: the smallest of them caps `after`.
    others = min((t for k, t in enumerate(totals) if k not in (src, dst)), default=math.inf)
    if others <= floor and not out_of_balance:
        return None  # another stage sits at (about) the bottleneck: no single move lifts it
    payback = config.horizon_s - config.move_cost_s
    # (-after, -lifted, crowding, lost, -gained, peer)
    best: tuple[float, float, tuple[int, int], float, float, str] | None = None
    for peer in members[src]:
        row = speeds[peer]
        lost, gained = row[src], row[dst]
        if gained <= 0.0:
            continue
        moved = last_moved.get(peer)
        if moved is not None and now - moved < config.min_dwell_s:
            continue
        lifted = min(totals[src] - lost, totals[dst] + gained)  # the two stages' new minimum
        if lifted <= floor:
            continue
        # With a tie the bottleneck stays (`after` = `before`) and the gain comes once the tied
        # stages are lifted too, a move each: weigh the cost against the gain of this one stage.
        after = min(others, lifted)
        if (lifted - before) * payback <= lost * config.move_cost_s:
            continue
        crowd = move_crowding(peer, members[src], members[dst], domains)
        key = (-after, -lifted, crowd, lost, -gained, peer)
        if best is None or key < best:
            best = key
    if best is None:
        return None
    return Move(peer=best[-1], src=src, dst=dst, before=before, after=-best[0])


class Rebalancer:
    """`plan_move` with the memory it needs across decisions: when each peer last moved. Entries
    older than `min_dwell_s` weigh nothing in a decision and are dropped, so the memory stays as
    small as the recent moves."""

    def __init__(self, config: RebalanceConfig | None = None, min_replicas: int = 1) -> None:
        self.config = config or RebalanceConfig()
        self.min_replicas = min_replicas  # the job's: no move takes a stage below it
        self.last_moved: dict[str, float] = {}

    def decide(
        self,
        assignment: Mapping[str, int],
        speeds: Mapping[str, Sequence[float]],
        num_stages: int,
        now: float,
        domains: Mapping[str, Domains] | None = None,
    ) -> Move | None:
        """The move to order now (remembered as made), or None; arguments as for `plan_move`."""
        dwell = self.config.min_dwell_s
        self.last_moved = {p: t for p, t in self.last_moved.items() if now - t < dwell}
        move = plan_move(
            assignment,
            speeds,
            num_stages,
            now=now,
            last_moved=self.last_moved,
            config=self.config,
            min_replicas=self.min_replicas,
            domains=domains,
        )
        if move is not None:
            self.last_moved[move.peer] = now
        return move

    def refill(
        self,
        assignment: Mapping[str, int],
        speeds: Mapping[str, Sequence[float]],
        num_stages: int,
        now: float,
        domains: Mapping[str, Domains] | None = None,
    ) -> list[Move]:
        """`plan_refill`'s moves (remembered as made: the stages they fill hold no other move's
        peer within `min_dwell_s`, and the moved peers stay put as long)."""
        moves = plan_refill(
            assignment, speeds, num_stages, min_replicas=self.min_replicas, domains=domains
        )
        for move in moves:
            self.last_moved[move.peer] = now
        return moves

    def forget(self, peer: str) -> None:
        """`peer` left."""
        self.last_moved.pop(peer, None)
