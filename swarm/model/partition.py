"""Cutting a model's layers into pipeline stages: contiguous, non-empty ranges whose largest cost
(the pipeline's bottleneck) is as small as can be.

Every role computes the ranges from the job alone (the scheduler to show a job's stages, each
stage server to build its layers, the reference trainer), so they must be the same everywhere and
in every version: they are those of the exact dynamic programme swarm always ran,

    best[s][i] = min over j of max(best[s-1][j], prefix[i] - prefix[j])

scanning j upwards and taking a value only when it is smaller than the one held by more than a
relative 1e-9 (float sums differ), so ties go to the earliest split. Run as written, it takes
stages x layers^2 steps (2,000 stages of 20,000 layers: two days). This computes the very same
table, cell by cell, scanning for each cell only the few j where that scan can change its mind:

- it starts at a *restart* j0: one where v(j0) < (prefix[i] - prefix[j0 - 1]) - 1e-9 v(j0). Every
  earlier v(k) >= prefix[i] - prefix[k] >= prefix[i] - prefix[j0 - 1] (prefixes of costs >= 0
  never decrease, and rounding keeps order), so whatever the scan held before j0, it takes v(j0)
  there: from j0 on, the scan from j0 is the scan from the start. The first j is a restart.
- it ends at a *stop*: once no later best[s-1][j'] (a lower bound of v(j')) is below the value
  held, no later j' is taken.

Each row is scanned for every i at once (numpy float64: the same IEEE arithmetic, operation for
operation) over a short window around where best[s-1][j] meets prefix[i] - prefix[j]; a cell whose
window does not start at a restart and end at a stop is scanned one j at a time from a restart.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from swarm.errors import ConfigError

__all__ = ["partition"]

_TIES = 1e-9  # relative: a value must be smaller than the one held by more than this
_BEFORE = 2  # the window starts this many j before the estimated crossing
_WIDTH = 5  # and scans this many j

Floats = NDArray[np.float64]
Ints = NDArray[np.int64]


def partition(costs: Sequence[float], stages: int) -> list[range]:
    """Split layers of `costs` (finite, >= 0) into `stages` contiguous, non-empty ranges minimising
    the largest stage cost. Deterministic (ties go to the earliest split), about stages x layers
    steps, and cached: a job's partition is a pure function of its model and stage count."""
    return list(_partition(tuple(costs), stages))


@functools.lru_cache(maxsize=64)
def _partition(costs: tuple[float, ...], stages: int) -> tuple[range, ...]:
    n = len(costs)
    if not 1 <= stages <= n:
        raise ConfigError(f"training.stages = {stages} is not allowed; use 1..{n} for {n} layers")
    prefix = [0.0]
    for c in costs:
        if not (math.isfinite(c) and c >= 0):
            raise ConfigError(f"layer costs must be finite numbers >= 0, got {c!r}")
        prefix.append(prefix[-1] + c)
    if not math.isfinite(prefix[-1]):
        raise ConfigError(f"layer costs sum to {prefix[-1]}: too large to compare")
    p = np.array(prefix, dtype=np.float64)
    # Stage 1 holds layers 0..i-1 whole: max(best[0][0], prefix[i] - prefix[0]) = prefix[i].
    best = np.full(n + 1, math.inf)
    last = n - (stages - 1)  # the most layers the first s stages may hold, for s = 1
    best[1 : last + 1] = np.maximum(0.0, p[1 : last + 1] - p[0])
    cuts: list[Ints] = [np.zeros(last, dtype=np.int64)]  # cuts[s - 1][i - s]: where stage s starts
    for s in range(2, stages + 1):
        best, cut = _row(p, best, s, n - (stages - s))
        cuts.append(cut)
    bounds = [n]
    for s in range(stages, 0, -1):
        bounds.append(int(cuts[s - 1][bounds[-1] - s]))
    bounds.reverse()
    return tuple(range(bounds[k], bounds[k + 1]) for k in range(stages))


def _row(p: Floats, prev: Floats, s: int, hi: int) -> tuple[Floats, Ints]:
    """best[s][i] and cut[s][i] for i in s..hi from `prev` = best[s-1] (finite over s-1..hi-1, the
    candidates j of every i here)."""
    lo = s - 1
    i = np.arange(s, hi + 1)
    a = prev[lo:hi]
    # Where the rising best[s-1][j] (made monotone) meets the falling prefix[i] - prefix[j].
    cross = lo + np.searchsorted(np.maximum.accumulate(a) + p[lo:hi], p[i])
    start = np.clip(cross - _BEFORE, lo, i - 1)
    end = np.minimum(start + _WIDTH - 1, i - 1)  # the last j scanned
    cur = np.maximum(prev[start], p[i] - p[start])
    cut = start.copy()
    restart = (start == lo) | (cur < (p[i] - p[np.maximum(start - 1, 0)]) - _TIES * cur)
    for k in range(1, _WIDTH):
        j = np.minimum(start + k, end)
        value = np.maximum(prev[j], p[i] - p[j])
        take = (start + k <= end) & (value < cur - _TIES * value)
        cur = np.where(take, value, cur)
        cut = np.where(take, j, cut)
    # floor[j - lo]: the least best[s-1][j'] over j' >= j (j' >= i too: a lower floor, safe).
    floor = np.append(np.minimum.accumulate(a[::-1])[::-1], math.inf)
    stop = (end == i - 1) | (floor[end + 1 - lo] >= cur)
    unsure = np.flatnonzero(~(restart & stop))
    if unsure.size:
        lists = p.tolist(), prev.tolist(), floor.tolist()
        for k in unsure.tolist():
            cur[k], cut[k] = _scan(*lists, lo, s + k, int(start[k]))
    row = np.full(len(p), math.inf)
    row[s : hi + 1] = cur
    return row, cut


def _scan(
    p: list[float], prev: list[float], floor: list[float], lo: int, i: int, start: int
) -> tuple[float, int]:
    """Cell i one j at a time, as the programme scans it: from the last restart at or before
    `start` to a stop."""
    j0, pi = start, p[i]
    value = max(prev[j0], pi - p[j0])
    while j0 > lo and not value < (pi - p[j0 - 1]) - _TIES * value:
        j0 -= 1
        value = max(prev[j0], pi - p[j0])
    held, cut = value, j0
    for j in range(j0 + 1, i):
        if floor[j - lo] >= held:
            break
        value = max(prev[j], pi - p[j])
        if value < held - _TIES * value:
            held, cut = value, j
    return held, cut
