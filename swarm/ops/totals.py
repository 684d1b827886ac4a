"""Sums of what peers report or send (their checksums' dots, norms and digests), as the trust
checks take them: `math.fsum`'s exact float sum, which raises on +inf beside -inf and on an
intermediate overflow. A report is any member's or any lessee's word, so one report of two
infinities raised in the coordinator's commit, and the job failed as a bug; and a sender's
infinities spread over a part's blocks raised in its owner's checksums of what it summed, and
the honest owner's round aborted, naming it. Here it is NaN: a comparison with it is false, no
evidence either way, and each check says what a NaN means to it."""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["reported_sum"]


def reported_sum(values: Iterable[float]) -> float:
    """`math.fsum(values)`; NaN where that raises."""
    listed = list(values)
    try:
        return math.fsum(listed)
    except (ValueError, OverflowError):
        return math.nan
