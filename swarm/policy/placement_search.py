"""`place`'s local search: moves, swaps and group exchanges that raise the bottleneck, and the
iterated local search around them (`swarm.policy.placement` explains what it guarantees)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

__all__ = ["Search", "better", "close", "improve", "score"]

# Totals are sums of floats taken in different orders; two bottlenecks this close are equal, so a
# "move" that only reorders float error is not an improvement (and the search cannot cycle on it).
_REL_TOL = 1e-9
# Iterated local search: peers moved by one kick, and the fixed seed that keeps place() a function.
_KICK_MOVES = 3
_SEED = 0


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=_REL_TOL)


def score(totals: Sequence[float]) -> tuple[float, int]:
    """What the search raises: the bottleneck, then (at a tie) fewer stages sitting at it. The
    second part lets it climb off a plateau where two stages share the bottleneck and no single
    change raises both."""
    low = min(totals)
    return low, -sum(1 for t in totals if close(t, low))


def better(a: tuple[float, int], b: tuple[float, int]) -> bool:
    if close(a[0], b[0]):
        return a[1] > b[1]
    return a[0] > b[0]


class Search:
    """Local search state over peer indices (peers in id order), with the evaluation budget."""

    def __init__(self, rows: list[Sequence[float]], stage_of: list[int], num_stages: int) -> None:
        self.rows = rows
        self.stage_of = stage_of
        self.num_stages = num_stages
        self.totals = [0.0] * num_stages
        self.sizes = [0] * num_stages
        for i, stage in enumerate(stage_of):
            self.totals[stage] += rows[i][stage]
            self.sizes[stage] += 1
        self.order = sorted(range(num_stages), key=self.totals.__getitem__)
        self.budget = 0
        self.floor = 1  # no move takes a stage below this many replicas (min_replicas)

    def score(self) -> tuple[float, int]:
        return score(self.totals)

    def snapshot(self) -> tuple[list[int], list[float], list[int]]:
        return self.stage_of.copy(), self.totals.copy(), self.sizes.copy()

    def restore(self, state: tuple[list[int], list[float], list[int]]) -> None:
        self.stage_of, self.totals, self.sizes = state[0].copy(), state[1].copy(), state[2].copy()
        self.order = sorted(range(self.num_stages), key=self.totals.__getitem__)

    def move(self, changes: Sequence[tuple[int, int]]) -> None:
        rows, totals, sizes = self.rows, self.totals, self.sizes
        for i, stage in changes:
            old = self.stage_of[i]
            totals[old] -= rows[i][old]
            sizes[old] -= 1
            totals[stage] += rows[i][stage]
            sizes[stage] += 1
            self.stage_of[i] = stage
        self.order = sorted(range(self.num_stages), key=totals.__getitem__)

    def descend(self) -> None:
        """Apply the best improving move, else swap, else group swap, until none is left or the
        budget is spent. Only changes that touch a bottleneck stage are tried: any other leaves
        every bottleneck total alone, so it can neither raise the minimum nor thin the stages at
        it."""
        while self.budget > 0:
            score = self.score()
            lows = [k for k in range(self.num_stages) if close(self.totals[k], score[0])]
            change = (
                self._best_move(lows, score)
                or self._best_swap(lows, score)
                or self._best_group_swap(lows, score)
            )
            if not change:
                return
            self.move(change)

    def _pairscore(self, j: int, a: float, k: int, b: float) -> tuple[float, int]:
        """`_score` after stages j and k change their totals to a and b: O(1) plus ties, using
        the stages sorted by total."""
        totals = self.totals
        low, count = math.inf, 0
        for stage in self.order:
            if stage in (j, k):
                continue
            if count == 0:
                low, count = totals[stage], 1
            elif close(totals[stage], low):
                count += 1
            else:
                break
        new = min(a, b, low)
        ties = (count if close(low, new) else 0) + close(a, new) + close(b, new)
        return new, -ties

    def _best_move(self, lows: list[int], score: tuple[float, int]) -> list[tuple[int, int]]:
        rows, totals, sizes, stage_of = self.rows, self.totals, self.sizes, self.stage_of
        best, change = score, []
        for k in lows:
            self.budget -= len(rows)
            for i, row in enumerate(rows):
                j = stage_of[i]
                if j == k or row[k] <= 0.0 or sizes[j] <= self.floor:  # never below the floor
                    continue
                a = totals[j] - row[j]
                if a < score[0]:  # stage j would fall below the bottleneck
                    continue
                new = self._pairscore(j, a, k, totals[k] + row[k])
                if better(new, best):
                    best, change = new, [(i, k)]
        return change

    def _best_swap(self, lows: list[int], score: tuple[float, int]) -> list[tuple[int, int]]:
        rows, totals, stage_of = self.rows, self.totals, self.stage_of
        best, change = score, []
        for k in lows:
            inside = [q for q, stage in enumerate(stage_of) if stage == k]
            self.budget -= len(inside) * len(rows)
            for i, row in enumerate(rows):
                j = stage_of[i]
                if j == k or row[k] <= 0.0:
                    continue
                for q in inside:
                    other = rows[q]
                    gain = row[k] - other[k]
                    if gain <= 0.0 or other[j] <= 0.0:  # stage k must rise; q must fit in j
                        continue
                    a = totals[j] - row[j] + other[j]
                    if a < score[0]:
                        continue
                    new = self._pairscore(j, a, k, totals[k] + gain)
                    if better(new, best):
                        best, change = new, [(i, k), (q, j)]
        return change

    def _best_group_swap(self, lows: list[int], score: tuple[float, int]) -> list[tuple[int, int]]:
        """Exchange all replicas of a bottleneck stage with all of another stage: with stages of
        unequal cost a group that suits a cheap stage can be stuck on a costly one, and no single
        move or swap frees it without first lowering the bottleneck."""
        count = self.num_stages
        would = [[0.0] * count for _ in range(count)]  # would[j][k]: stage j's peers on stage k
        usable = [[True] * count for _ in range(count)]
        for i, row in enumerate(self.rows):
            j = self.stage_of[i]
            for k in range(count):
                would[j][k] += row[k]
                usable[j][k] = usable[j][k] and row[k] > 0.0
        self.budget -= len(self.rows)
        best, pair = score, (0, 0)
        for k in lows:
            for j in range(count):
                if j != k and usable[j][k] and usable[k][j]:
                    new = self._pairscore(j, would[k][j], k, would[j][k])
                    if better(new, best):
                        best, pair = new, (j, k)
        j, k = pair
        if j == k:
            return []
        return [(i, j if s == k else k) for i, s in enumerate(self.stage_of) if s in pair]

    def kick(self, rng: random.Random, moves: int) -> None:
        """Move a few random peers to random stages (never taking one below the floor), off a
        local optimum."""
        for _ in range(moves):
            i = rng.randrange(len(self.rows))
            j = self.stage_of[i]
            targets = [k for k in range(self.num_stages) if k != j and self.rows[i][k] > 0.0]
            if self.sizes[j] > self.floor and targets:
                self.move([(i, rng.choice(targets))])


def improve(search: Search, rounds: int, budget: int) -> None:
    """Iterated local search: descend, then `rounds` times kick the current placement and descend
    again, keeping the result unless it is worse (sideways steps let it wander a plateau), and
    finally restore the best placement seen. Seeded, so the output depends only on the input."""
    rng = random.Random(_SEED)
    search.budget = budget
    search.descend()
    best_score, best = search.score(), search.snapshot()
    current_score, current = best_score, best
    for _ in range(rounds):
        if search.budget <= 0:
            break
        search.kick(rng, _KICK_MOVES)
        search.descend()
        score = search.score()
        if better(current_score, score):
            search.restore(current)
            continue
        current_score, current = score, search.snapshot()
        if better(score, best_score):
            best_score, best = score, current
    search.restore(best)
