"""Failure domains: what one outage takes out together, so a stage's replicas are spread over them.

Pure policy over plain data (docs/architecture.md, "Policies"). A peer has two domains: its
`host` (the machine: stage servers on one machine share it) and its `router` (the public address
its traffic leaves from: a home's peers share their router). The scheduler derives them from the
announcements (`scheduler.registry.PeerRegistry.domains`; docs/decisions.md, "Failure domains");
a peer with none known counts as a domain of its own, so missing facts never claim a conflict.

A stage's *crowding* is, per kind, its replicas minus the distinct domains they sit in: 0 when
every replica is in a domain of its own, 1 for two replicas behind one router. Placement and
rebalancing lower it where that costs little throughput:
- `spread` (after `place`): moves and swaps that lower the crowding, hosts first, then routers,
  while the bottleneck stays at least (1 - `SPREAD_SLACK`) of what placement found (no move takes
  a stage below `min_replicas`);
- `prefer_new` (a joining peer, `placement._fill`): among the stages within `SPREAD_SLACK` of its
  best `after`, those where it adds no host, then no router, already there; while it fills
  `min_replicas`, among every stage below it (each takes a peer anyway, so which one first costs
  no throughput once they all have their floor);
- `move_crowding` (rebalancing's tie-breaker between moves of equal gain, and the refill's).
`crowded` names the stages whose replicas (two or more) all sit in one domain: spreading could not
help them (every peer that could serve elsewhere would cost too much, or there is none), and the
job's status says so (`scheduler.stalls`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "SPREAD_SLACK",
    "Domains",
    "crowded",
    "crowding",
    "move_crowding",
    "prefer_new",
    "spread",
]

SPREAD_SLACK = 0.05
"""The share of the bottleneck spreading may give up: among placements within 5% of the best
found, the one with the fewest replicas sharing a host, then a router. An outage of a crowded
domain stops its stage (the whole job), which no few percent of speed is worth."""

# Candidate changes `spread` examines in all: a bound like `place`'s budget (O(crowded x P) each).
_BUDGET = 2_000_000


@dataclass(frozen=True, slots=True)
class Domains:
    """A peer's failure domains: `host` (its machine), `router` (its public address)."""

    host: str
    router: str


def _keys(peer: str, domains: Mapping[str, Domains]) -> tuple[str, str]:
    """`peer`'s (host, router); a domain not known is the peer's own (it shares it with none)."""
    d = domains.get(peer)
    host = d.host if d is not None and d.host else f"peer:{peer}"
    router = d.router if d is not None and d.router else f"peer:{peer}"
    return host, router


def crowding(members: Sequence[Sequence[str]], domains: Mapping[str, Domains]) -> tuple[int, int]:
    """Summed over stages (`members`: each stage's peers): replicas beyond the first in each host,
    and in each router."""
    hosts = routers = 0
    for peers in members:
        keys = [_keys(p, domains) for p in peers]
        hosts += len(keys) - len({h for h, _ in keys})
        routers += len(keys) - len({r for _, r in keys})
    return hosts, routers


def crowded(
    members: Sequence[Sequence[str]], domains: Mapping[str, Domains]
) -> list[tuple[int, str, str]]:
    """(stage, "host" or "router", the domain) for each stage whose two or more replicas all sit
    on one host (said as such), else all behind one router."""
    result = []
    for stage, peers in enumerate(members):
        if len(peers) < 2:
            continue
        hosts = {_keys(p, domains)[0] for p in peers}
        routers = {_keys(p, domains)[1] for p in peers}
        if len(hosts) == 1:
            result.append((stage, "host", hosts.pop()))
        elif len(routers) == 1:
            result.append((stage, "router", routers.pop()))
    return result


def move_crowding(
    peer: str,
    src: Sequence[str],
    dst: Sequence[str],
    domains: Mapping[str, Domains] | None,
) -> tuple[int, int]:
    """How `peer` moving from the stage of `src` (its replicas, `peer` among them) to that of `dst`
    changes the crowding (hosts, routers): negative spreads, positive crowds. (0, 0) without
    `domains`."""
    if not domains:
        return 0, 0
    host, router = _keys(peer, domains)
    change = [0, 0]
    for i, mine in enumerate((host, router)):
        left = sum(1 for p in src if p != peer and _keys(p, domains)[i] == mine)
        there = sum(1 for p in dst if p != peer and _keys(p, domains)[i] == mine)
        change[i] = (1 if there else 0) - (1 if left else 0)
    return change[0], change[1]


def prefer_new(
    row: Sequence[float],
    totals: Sequence[float],
    there: Sequence[Sequence[tuple[str, str]]],
    mine: tuple[str, str],
    *,
    filling: bool = False,
) -> list[float]:
    """`row` (a joining peer's speeds) with only the stages it is best to join left positive:
    those whose `after` (the bottleneck once it joins, as `placement.best_stage` counts it) is
    within `SPREAD_SLACK` of the best, and among them the ones where its host, then its router,
    is new (`there`: each stage's (host, router) keys, as `_keys` gives them). `filling`: `row`
    holds only stages below `min_replicas`, each of which takes a peer anyway: all of them are
    near (CI, test_failure_domains_nat: two peers of two homes placed first, one a stage 9%
    apart, and each of the next two joined the slower stage, beside its own home's peer)."""
    usable = [k for k, s in enumerate(row) if s > 0.0]
    if len(usable) < 2:
        return list(row)
    low = min(range(len(totals)), key=totals.__getitem__)
    second = min((t for k, t in enumerate(totals) if k != low), default=math.inf)
    after = {k: min(totals[k] + row[k], second if k == low else totals[low]) for k in usable}
    top = max(after.values())
    near = usable if filling else [k for k in usable if after[k] >= top * (1.0 - SPREAD_SLACK)]
    shared = {
        k: (mine[0] in {h for h, _ in there[k]}, mine[1] in {r for _, r in there[k]}) for k in near
    }
    best = min(shared.values())
    return [s if k in shared and shared[k] == best else 0.0 for k, s in enumerate(row)]


def keys_of(peers: Sequence[str], domains: Mapping[str, Domains]) -> list[tuple[str, str]]:
    """Each peer's (host, router) keys, as the functions here compare them."""
    return [_keys(p, domains) for p in peers]


def spread(
    assignment: Mapping[str, int],
    speeds: Mapping[str, Sequence[float]],
    num_stages: int,
    domains: Mapping[str, Domains],
    *,
    min_replicas: int = 1,
    budget: int = _BUDGET,
) -> dict[str, int]:
    """`assignment` with its replicas spread over their domains: the first crowded replica (in
    id order) that can lower the crowding moves to another stage or swaps with a replica of
    another stage, the change that lowers it most (hosts, then routers; then the one leaving the
    higher bottleneck), and again, while the bottleneck stays at least (1 - `SPREAD_SLACK`) of
    `assignment`'s and no stage falls below `min_replicas` (nor to none). Every change lowers
    the crowding, so it ends; each costs O(P). Measured here: at 1,000 peers x 16 stages on 300
    hosts behind 150 routers, 0.1 s, every crowding gone, the bottleneck 0.9% lower."""
    if not domains or num_stages < 2:
        return dict(assignment)
    crowding = _Crowding(assignment, speeds, num_stages, domains)
    floor = min(crowding.totals) * (1.0 - SPREAD_SLACK)
    keep = max(1, min_replicas)
    # Each round: the first crowded peer (in id order) with a change that lowers the crowding
    # makes its best one (most crowding removed, then the highest bottleneck). O(P) a change.
    peers = sorted(crowding.stage_of)
    while budget > 0:
        change: list[tuple[str, int]] = []
        for p in peers:
            if not crowding.crowded(p):
                continue
            # a move leaves its stage one replica fewer: only where it keeps more than `keep`
            candidates = [None, *peers] if crowding.sizes[crowding.stage_of[p]] > keep else peers
            budget -= len(candidates)
            change = crowding.best_change(p, candidates, floor)
            if change:
                break
        if not change:
            break
        for p, b in change:
            crowding.shift(p, b)
    return dict(sorted(crowding.stage_of.items()))


class _Crowding:
    """A placement as `spread` changes it: each stage's replicas counted by host and by router,
    its total speed and its size, kept up to date as replicas move, so that weighing a change
    costs O(1)."""

    def __init__(
        self,
        assignment: Mapping[str, int],
        speeds: Mapping[str, Sequence[float]],
        num_stages: int,
        domains: Mapping[str, Domains],
    ) -> None:
        self.stage_of = dict(assignment)
        self.speeds, self.num_stages = speeds, num_stages
        self.keys = {p: _keys(p, domains) for p in self.stage_of}
        self.totals = [0.0] * num_stages
        self.counts = [
            [Counter[str]() for _ in range(num_stages)] for _ in range(2)
        ]  # [kind][stage]
        self.sizes = [0] * num_stages
        for p, k in self.stage_of.items():
            self.totals[k] += speeds[p][k]
            self.sizes[k] += 1
            for i in range(2):
                self.counts[i][k][self.keys[p][i]] += 1

    def crowded(self, p: str) -> bool:
        """Whether `p` shares its stage with another replica of its host or its router."""
        a = self.stage_of[p]
        return self.counts[0][a][self.keys[p][0]] >= 2 or self.counts[1][a][self.keys[p][1]] >= 2

    def best_change(
        self, p: str, candidates: Sequence[str | None], floor: float
    ) -> list[tuple[str, int]]:
        """`p`'s change that removes the most crowding (then leaves the highest bottleneck),
        keeping the bottleneck at least `floor`: a move to another stage (candidate None) or a
        swap with a replica of another stage, as (peer, its new stage) pairs; [] if none."""
        speeds, a = self.speeds, self.stage_of[p]
        best: tuple[tuple[int, int], float] = ((0, 0), -math.inf)
        change: list[tuple[str, int]] = []
        for q in candidates:
            if q is not None and (self.stage_of[q] == a or speeds[q][a] <= 0.0):
                continue
            targets = range(self.num_stages) if q is None else (self.stage_of[q],)
            for b in targets:
                if b == a or speeds[p][b] <= 0.0:
                    continue
                g = self.gain(p, a, b, q)
                if g <= best[0] and not (g == best[0] and g > (0, 0)):
                    continue
                back = 0.0 if q is None else speeds[q][a]
                gone = 0.0 if q is None else speeds[q][b]
                ta = self.totals[a] - speeds[p][a] + back
                low = _low(self.totals, a, ta, b, self.totals[b] + speeds[p][b] - gone)
                if low >= floor and (g, low) > best:
                    best = (g, low)
                    change = [(p, b)] if q is None else [(p, b), (q, a)]
        return change

    def gain(self, p: str, a: int, b: int, q: str | None = None) -> tuple[int, int]:
        """Crowding removed by `p` going from a to b, with `q` coming from b to a if given (a
        swap: sizes stay, so it is the distinct domains gained)."""
        result = []
        for i in range(2):
            here, there, mine = self.counts[i][a], self.counts[i][b], self.keys[p][i]
            if q is None:
                result.append((here[mine] > 1) - (there[mine] > 0))
                continue
            theirs = self.keys[q][i]
            same = mine == theirs
            result.append(
                -(here[mine] == 1)
                + (here[theirs] - same == 0)
                - (there[theirs] == 1)
                + (there[mine] - same == 0)
            )
        return result[0], result[1]

    def shift(self, p: str, b: int) -> None:
        """`p` moves to stage `b`."""
        a = self.stage_of[p]
        for i in range(2):
            self.counts[i][a][self.keys[p][i]] -= 1
            self.counts[i][b][self.keys[p][i]] += 1
        self.totals[a] -= self.speeds[p][a]
        self.totals[b] += self.speeds[p][b]
        self.sizes[a] -= 1
        self.sizes[b] += 1
        self.stage_of[p] = b


def _low(totals: Sequence[float], a: int, ta: float, b: int, tb: float) -> float:
    """The bottleneck once stages a and b have totals ta and tb."""
    return min(min((t for k, t in enumerate(totals) if k not in (a, b)), default=math.inf), ta, tb)
