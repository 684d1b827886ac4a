"""Placement: which stage each peer serves, from the samples/s it measured on each stage's compute.

Pure policy over plain data (docs/architecture.md, "Policies"); the scheduler's registry feeds it
and the simulator reuses it. Every sample passes every stage, so the job runs at its *bottleneck*:
the smallest, over stages, of the summed throughput of the stage's replicas. Placement maximises it.
Peers joining a running job go to their `best_stage`, `place` plans a whole set of peers, and
`place_new` picks between the two: the scheduler and the simulator both call it.

The exact problem is NP-hard: with two stages and peers equally fast on both, deciding whether the
bottleneck can reach half the total speed is PARTITION. In general (peers of different speeds on
stages of different cost) it is max-min allocation on unrelated machines (the "Santa Claus"
problem), which no polynomial algorithm can even approximate within a factor below 2 unless P=NP.
So `place` is a heuristic, and what it guarantees is:
- every stage gets a replica whenever some assignment gives every stage one (a maximum matching
  covers the stages first); with exactly as many usable peers as stages the result is optimal;
- redundancy before throughput: with `min_replicas = m` (a job's `runtime.min_replicas`), every
  stage gets m replicas before any stage gets more whenever some assignment gives every stage m
  (the matching has m slots per stage, filled round by round: every stage's first, then every
  stage's second, ...), and the search never takes a stage under m; with too few peers for m
  everywhere, no stage gets its (r+1)-th replica while one it could serve lacks its r-th;
- the result is never worse than the greedy fill (`best_stage` peer by peer) it starts from;
- unless the budget ran out, it is a local optimum: no move of a peer into a bottleneck stage, no
  swap of two peers across one and no exchange of two stages' replica groups raises the
  bottleneck (or, at a tie, lowers the number of stages at it);
- the output depends only on the input (peers in id order, a fixed seed for the random kicks).
Measured on random instances (tests/swarm/policy/test_placement.py asserts the figures for its own
seeds): with 3 to 7 peers on 3 stages it found the brute-force optimum in 3,999 of 4,000 cases,
the other at 0.987 of it (the greedy start alone: 3,370 of 4,000, worst 0.60); at 300 peers x 12
stages it is within 3.5% of `upper_bound`, at 1,000 x 16 within 2% (that bound may itself be
above the optimum).

A replica reached through a relay (a peer behind NAT) is slower than its compute: every call to it
crosses two links, the relay's, which its other peers share. `path_speeds` prices that before
placement sees the speeds: a relayed peer's samples/s times `RELAYED_FACTOR` (or the factor its
relay was measured at). Maximising the bottleneck over those prices then prefers direct peers
where a relay would be a stage's bottleneck, and puts relayed ones where others carry the stage.

With `domains` (each peer's host and router, `swarm.policy.domains`) both spread a stage's replicas
over distinct hosts, then routers, where that costs at most `SPREAD_SLACK` of the bottleneck:
`place` ends with `spread`, and a joining peer prefers a stage where its domains are new.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from swarm.policy.domains import Domains, keys_of, prefer_new, spread
from swarm.policy.placement_search import Search, better, close, improve, score

__all__ = [
    "RELAYED_FACTOR",
    "best_stage",
    "bottleneck",
    "path_speeds",
    "place",
    "place_new",
    "stage_totals",
    "stages_without_replicas",
    "upper_bound",
]

# Market prices (see `_prices`): update steps and the first step's size, as a fraction of a
# stage's gap to the mean total. Measured on 1,000 peers x 16 stages: more steps barely help.
_PRICE_STEPS = 100
_PRICE_RATE = 0.3
# A peer may join any stage where its speed is worth at least (1 - slack) of its best at market
# prices. Prices only approach the ideal ones, and peers of equal hardware are exactly tied, so a
# strict argmax herds them onto one stage; each slack here makes one candidate start.
_PRICE_SLACKS = (0.0, 0.02, 0.05, 0.1)

RELAYED_FACTOR = 0.5
"""The share of its measured samples/s a relayed replica is counted at when no measurement of its
relay's throughput says otherwise. Petals discounts a relayed server by 0.2 in routing, for
libp2p circuit relays over the public internet; a swarm's relay is one of its own reachable peers
(a gRPC proxy on a good link: a bare stream through one runs at half or more of a direct one,
issue 42's target), so half is the prior here."""


def path_speeds(
    speeds: Mapping[str, Sequence[float]],
    relayed: Mapping[str, float | None],
    factor: float = RELAYED_FACTOR,
) -> dict[str, list[float]]:
    """`speeds` as placement counts them: each peer in `relayed` at its factor (None: `factor`),
    a relay's measured share of a direct path where one is known; every other peer as measured."""
    if not 0.0 < factor <= 1.0:
        raise ValueError(f"relay factor {factor}: a share of the direct speed, in (0, 1]")
    result = {}
    for peer, row in speeds.items():
        share = 1.0
        if peer in relayed:
            measured = relayed[peer]
            share = factor if measured is None else min(max(measured, 0.0), 1.0)
        result[peer] = [v * share for v in row]
    return result


def stage_totals(
    assignment: Mapping[str, int], speeds: Mapping[str, Sequence[float]], num_stages: int
) -> list[float]:
    """Summed samples/s of each stage's replicas."""
    totals = [0.0] * num_stages
    for peer, stage in assignment.items():
        totals[stage] += speeds[peer][stage]
    return totals


def bottleneck(
    assignment: Mapping[str, int], speeds: Mapping[str, Sequence[float]], num_stages: int
) -> float:
    """The job's throughput under `assignment`: the smallest stage total (0 if a stage is empty)."""
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages}: a job has at least one stage")
    return min(stage_totals(assignment, speeds, num_stages))


def stages_without_replicas(assignment: Mapping[str, int], num_stages: int) -> list[int]:
    """Stages no peer is assigned to, ascending."""
    served = set(assignment.values())
    return [k for k in range(num_stages) if k not in served]


def best_stage(peer_speeds: Sequence[float], stage_totals: Sequence[float]) -> int:
    """The stage a joining peer should serve: the one that most raises the bottleneck
    `min_k total_k`. Ties (common: while two stages share the bottleneck, no single peer raises
    it) go to the stage with the smallest total, so the peer helps the weakest stage, then to the
    stage the peer is fastest on, then to the lowest index. A stage where the peer's speed is 0 (it
    cannot serve it) is never chosen. O(S)."""
    if len(peer_speeds) != len(stage_totals) or not stage_totals:
        raise ValueError(
            f"{len(peer_speeds)} speeds for {len(stage_totals)} stages: give one per stage"
        )
    usable = [k for k, s in enumerate(peer_speeds) if s > 0.0]
    if not usable:
        raise ValueError("the peer has no positive speed on any stage: it cannot serve one")
    # The bottleneck after joining stage k is min(total_k + speed_k, min of the other totals):
    # keep the two smallest totals so the second part is O(1).
    low = min(range(len(stage_totals)), key=stage_totals.__getitem__)
    second = min((t for k, t in enumerate(stage_totals) if k != low), default=math.inf)
    after = {
        k: min(stage_totals[k] + peer_speeds[k], second if k == low else stage_totals[low])
        for k in usable
    }
    top = max(after.values())
    return min(
        (k for k in usable if close(after[k], top)),
        key=lambda k: (stage_totals[k], -peer_speeds[k], k),
    )


def upper_bound(speeds: Mapping[str, Sequence[float]], num_stages: int) -> float:
    """A bottleneck no placement of these peers can exceed (the dual of the fractional problem),
    to judge placements where brute force is out of reach. O(_PRICE_STEPS * P * S)."""
    rows = _rows(speeds, num_stages)
    return _prices(rows, num_stages)[1]


def place(
    speeds: Mapping[str, Sequence[float]],
    num_stages: int,
    *,
    min_replicas: int = 1,
    rounds: int = 200,
    budget: int = 2_000_000,
    domains: Mapping[str, Domains] | None = None,
) -> dict[str, int]:
    """Assign peers to stages to maximise the bottleneck. `speeds[peer][k]` is the samples/s the
    peer measured on stage k's compute (0: it cannot serve stage k); peers with no positive speed
    are left out. Phases:
    1. cover: a maximum matching gives as many stages as possible one replica each, maximising
       the slowest of them. With fewer usable peers than stages the placement is partial
       (`stages_without_replicas` names the rest) and stops there. With `min_replicas` m > 1
       the matching has m slots per stage, filled round by round, so every stage gets m
       replicas before any gets more; with too few peers for that, those left join the stages
       with the fewest replicas where they raise the bottleneck most (`best_stage`), and the
       placement stops there;
    2. fill: the other peers, fastest first, each join their `best_stage` (greedy); a second kind
       of start lets them prefer stages where market prices value them most (`_prices`), and the
       better start is kept;
    3. local search: moves into, swaps across and group exchanges with a bottleneck stage while
       they raise it, then up to `rounds` of iterated local search (a few random moves, descend
       again). `budget` bounds the candidate changes examined in all, so small jobs get every
       round and large ones stop early (about 1.5 s at 3,000 peers x 32 stages here);
    4. with `domains`: `spread` over them (`swarm.policy.domains`)."""
    placed = _place(speeds, num_stages, min_replicas, rounds, budget)
    if not domains:
        return placed
    return spread(placed, speeds, num_stages, domains, min_replicas=min_replicas)


def _place(
    speeds: Mapping[str, Sequence[float]],
    num_stages: int,
    min_replicas: int,
    rounds: int,
    budget: int,
) -> dict[str, int]:
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages}: a job has at least one stage")
    _check_min_replicas(min_replicas)
    peers = sorted(p for p, row in speeds.items() if max(_check_row(p, row, num_stages)) > 0.0)
    assignment = _cover(peers, speeds, num_stages, min_replicas)
    covered = stage_totals(assignment, speeds, num_stages)
    sizes = [0] * num_stages
    for stage in assignment.values():
        sizes[stage] += 1
    if min(sizes) < min_replicas:  # too few peers: the rest join the stages with the fewest
        _fill(peers, assignment, speeds, covered, floor=(sizes, min_replicas))
        return dict(sorted(assignment.items()))
    if len(peers) == num_stages:  # one peer per stage: the matching is the optimum
        return dict(sorted(assignment.items()))
    starts = [dict(assignment)]
    _fill(peers, starts[0], speeds, list(covered))
    prices = _prices([speeds[p] for p in peers], num_stages)[0]
    for slack in _PRICE_SLACKS:
        starts.append(dict(assignment))
        _fill(peers, starts[-1], speeds, list(covered), prices=prices, slack=slack)
    start = starts[0]
    for other in starts[1:]:
        if better(_score_of(other, speeds, num_stages), _score_of(start, speeds, num_stages)):
            start = other
    search = Search([speeds[p] for p in peers], [start[p] for p in peers], num_stages)
    search.floor = min_replicas
    improve(search, rounds, budget)
    return dict(zip(peers, search.stage_of, strict=True))


def place_new(
    speeds: Mapping[str, Sequence[float]],
    num_stages: int,
    totals: Sequence[float] | None = None,
    *,
    min_replicas: int = 1,
    sizes: Sequence[int] | None = None,
    domains: Mapping[str, Domains] | None = None,
    members: Sequence[Sequence[str]] | None = None,
) -> dict[str, int]:
    """Stages for peers not placed yet: the one placement decision of the scheduler and the
    simulator. `totals=None` (nothing serves the job yet) is `place`. Otherwise `totals` are the
    stages' summed samples/s now (a running job), and each new peer, fastest first, joins its
    `best_stage` as the totals grow: peers already serving stay put (moving them is rebalancing's
    call, which weighs what a move costs). With `sizes` (the replicas each stage has now), a new
    peer joins one of the stages with the fewest replicas while some stage it can serve has
    fewer than `min_replicas`: redundancy before throughput. With `domains` (the new peers' and
    `members'`, each stage's peers now), among stages of about equal value (`prefer_new`) a new
    peer joins one where its host, then its router, is new. Peers with no positive speed are
    left out."""
    _check_min_replicas(min_replicas)
    if totals is None:
        return place(speeds, num_stages, min_replicas=min_replicas, domains=domains)
    if len(totals) != num_stages or (sizes is not None and len(sizes) != num_stages):
        raise ValueError(f"{len(totals)} stage totals for {num_stages} stages: give one per stage")
    peers = sorted(p for p, row in speeds.items() if max(_check_row(p, row, num_stages)) > 0.0)
    assignment: dict[str, int] = {}
    floor = (list(sizes), min_replicas) if sizes is not None else None
    there = None
    if domains:
        there = ([keys_of(ps, domains) for ps in members or [[]] * num_stages], domains)
    _fill(peers, assignment, speeds, list(totals), floor=floor, there=there)
    return dict(sorted(assignment.items()))


def _check_row(peer: str, row: Sequence[float], num_stages: int) -> Sequence[float]:
    if len(row) != num_stages or not all(math.isfinite(s) and s >= 0.0 for s in row):
        raise ValueError(
            f"peer {peer!r}: give {num_stages} finite speeds >= 0, one per stage, not {row!r}"
        )
    return row


def _check_min_replicas(min_replicas: int) -> None:
    if min_replicas < 1:
        raise ValueError(f"min_replicas={min_replicas}: give an integer >= 1")


def _rows(speeds: Mapping[str, Sequence[float]], num_stages: int) -> list[Sequence[float]]:
    return [
        row for peer, row in sorted(speeds.items()) if max(_check_row(peer, row, num_stages)) > 0.0
    ]


def _fill(
    peers: list[str],
    assignment: dict[str, int],
    speeds: Mapping[str, Sequence[float]],
    totals: list[float],
    *,
    prices: Sequence[float] | None = None,
    slack: float = 0.0,
    floor: tuple[list[int], int] | None = None,
    there: tuple[list[list[tuple[str, str]]], Mapping[str, Domains]] | None = None,
) -> None:
    """Each unplaced peer, fastest first (as in LPT scheduling: a large peer placed last would
    overshoot its stage), joins its `best_stage` on `totals` (updated as it goes). With `prices`,
    only among the stages where its speed is worth at least (1 - slack) of its best at them.
    With `floor` = (sizes, m), only among the stages with the fewest replicas below m that it
    can serve, while there are such (`sizes` updated as it goes). With `there` = (each stage's
    domain keys, the domains), among those of about equal value (any of them, while it fills
    the floor) where its domains are new (`prefer_new`; the keys updated as it goes)."""
    for peer in sorted((p for p in peers if p not in assignment), key=lambda p: -max(speeds[p])):
        row = speeds[peer]
        if prices is not None:
            worth = [price * s for price, s in zip(prices, row, strict=True)]
            least = (1.0 - slack) * max(worth)
            row = [s if w >= least else 0.0 for s, w in zip(row, worth, strict=True)]
        filling = False
        if floor is not None:
            row, filling = _shortest(row, *floor)
        if there is not None:
            mine = keys_of([peer], there[1])[0]
            row = prefer_new(row, totals, there[0], mine, filling=filling)
        stage = best_stage(row, totals)
        if there is not None:
            there[0][stage].append(mine)
        assignment[peer] = stage
        totals[stage] += speeds[peer][stage]
        if floor is not None:
            floor[0][stage] += 1


def _shortest(
    row: Sequence[float], sizes: Sequence[int], floor: int
) -> tuple[Sequence[float], bool]:
    """`row` with only the stages it can serve that have the fewest replicas below `floor` left
    positive, and True; `row` itself and False when it can serve none below `floor`."""
    for level in sorted({n for n in sizes if n < floor}):
        short = [s if n == level else 0.0 for s, n in zip(row, sizes, strict=True)]
        if max(short) > 0.0:
            return short, True
    return row, False


def _prices(rows: list[Sequence[float]], num_stages: int) -> tuple[list[float], float]:
    """Market prices for stages, and the upper bound on the bottleneck they prove.

    The greedy fill is myopic: it puts a peer on today's bottleneck stage even when the peer is
    relatively poor there, and with thousands of peers local search needs thousands of small
    steps to undo that. Prices see comparative advantage. They are the dual of the fractional
    problem (maximise T with sum_p x_pk * s_pk >= T, sum_k x_pk = 1): for prices y >= 0,
    sum_p max_k y_k * s_pk / sum_k y_k bounds T from above, and at the best prices each peer
    belongs to a stage maximising y_k * s_pk. Minimising that bound by multiplicative steps
    (cheaper stages for those over the mean total, dearer for those under: a subgradient method)
    approaches those prices; the ones with the lowest bound are kept."""
    if not rows or any(max(row[k] for row in rows) <= 0.0 for k in range(num_stages)):
        return [1.0] * num_stages, 0.0  # some stage nobody can serve
    stages = range(num_stages)
    prices = [len(rows) / sum(row[k] for row in rows) for k in stages]  # 1 / mean speed
    best_prices, best_bound = prices, math.inf
    for step in range(_PRICE_STEPS):
        totals = [0.0] * num_stages
        worth = 0.0
        for row in rows:
            k = max(stages, key=lambda k: prices[k] * row[k])
            totals[k] += row[k]
            worth += prices[k] * row[k]
        bound = worth / sum(prices)
        if bound < best_bound:
            best_bound, best_prices = bound, prices
        mean = sum(totals) / num_stages
        rate = _PRICE_RATE / math.sqrt(step + 1)
        prices = [
            p * math.exp(-rate * (t - mean) / mean) for p, t in zip(prices, totals, strict=True)
        ]
        top = max(prices)
        prices = [p / top for p in prices]  # only ratios matter; this keeps them in range
    return best_prices, best_bound


def _score_of(
    assignment: Mapping[str, int], speeds: Mapping[str, Sequence[float]], num_stages: int
) -> tuple[float, int]:
    return score(stage_totals(assignment, speeds, num_stages))


def _cover(
    peers: list[str], speeds: Mapping[str, Sequence[float]], num_stages: int, min_replicas: int
) -> dict[str, int]:
    """A maximum matching of peers to `min_replicas` slots per stage over positive speeds that
    gives as many stages as possible a first replica, then as many as possible a second, ...
    (the slots are taken round by round: augmenting paths never unmatch a slot), and maximises
    its slowest edge: binary search on that speed, augmenting paths at each threshold. Only
    each stage's `num_stages * min_replicas` fastest peers can matter (an optimal matching
    using any other peer for a stage leaves one of those free, and switching to it is no
    slower), so a check is O((S m)^3)."""
    candidates: dict[int, list[str]] = {}
    for k in range(num_stages):
        usable = [p for p in peers if speeds[p][k] > 0.0]
        usable.sort(key=lambda p: -speeds[p][k])  # stable: equal speeds stay in id order
        candidates[k] = usable[: num_stages * min_replicas]
    slots = [k for _ in range(min_replicas) for k in range(num_stages)]  # round by round
    thresholds = sorted({speeds[p][k] for k, ps in candidates.items() for p in ps})
    rounds = _rounds(_matching(slots, candidates, speeds, 0.0), num_stages)
    lo, hi = 0, len(thresholds) - 1  # the answer is the largest index still matching `rounds`
    best: dict[str, int] = {}
    while lo <= hi:
        mid = (lo + hi) // 2
        match = _matching(slots, candidates, speeds, thresholds[mid])
        if _rounds(match, num_stages) == rounds:
            best, lo = match, mid + 1
        else:
            hi = mid - 1
    return {peer: slots[slot] for peer, slot in best.items()}


def _rounds(owner: Mapping[str, int], num_stages: int) -> list[int]:
    """Matched slots per round of a slot matching."""
    counts = [0] * (max(owner.values(), default=0) // num_stages + 1)
    for slot in owner.values():
        counts[slot // num_stages] += 1
    return counts


def _matching(
    slots: Sequence[int],
    candidates: Mapping[int, list[str]],
    speeds: Mapping[str, Sequence[float]],
    threshold: float,
) -> dict[str, int]:
    """Maximum bipartite matching of peers to `slots` (each a stage) over edges at least
    `threshold`, slot by slot (Kuhn's augmenting paths, searched with a stack of their own:
    a path may pass every slot). Peer -> slot index."""
    owner: dict[str, int] = {}
    for start in range(len(slots)):
        seen: set[str] = set()
        stack = [(start, iter(candidates[slots[start]]))]
        path: list[str] = []  # path[i]: the peer stack[i]'s slot would take
        while stack:
            slot, untried = stack[-1]
            for peer in untried:
                if speeds[peer][slots[slot]] < threshold or peer in seen:
                    continue
                seen.add(peer)
                path.append(peer)
                if peer in owner:  # may its slot take another peer?
                    stack.append((owner[peer], iter(candidates[slots[owner[peer]]])))
                    break
                for (taker, _), taken in zip(stack, path, strict=True):
                    owner[taken] = taker
                stack.clear()
                break
            else:
                stack.pop()
                if path:
                    path.pop()
    return owner
