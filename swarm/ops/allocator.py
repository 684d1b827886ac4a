"""Giving a process's freed memory back to the system (glibc's `malloc_trim`).

A stage server's buffers come and go by the thousand each step (activations, averaging slices,
chunks in flight), from several threads' malloc arenas; glibc keeps what they free for reuse,
and an arena's freed pages are not reused by another thread's, so a replica's RSS climbs a
quarter GiB or more above its live memory by each commit (docs/bulk.md). A replica peaks in
a commit (its state and the averaging's buffers), in the optimizer's pass after it, and in the
next step's compute, so it gives its freed memory back before the commit's averaging and again
before the optimizer step: at a 248M-parameter stage of a pool of 2 the first lowered the peak
RSS by 0.3 GiB, the second by 0.2-0.4 GiB more, with no change in step time (the next step's
first touch of returned pages is a page fault each, spread over a compute-bound step).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

__all__ = ["give_back"]

log = logging.getLogger(__name__)


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim(pad)`, or None where the C library has none (musl, macOS)."""
    try:
        call = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    call.argtypes, call.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda pad: int(call(pad))


_MALLOC_TRIM = _load_malloc_trim()


def give_back() -> bool:
    """Return the freed memory of every malloc arena to the system; whether any was returned
    (False where the C library cannot). It takes the arenas' locks while it runs: call it where
    no allocation-heavy work runs beside it (a replica's worker, before a commit)."""
    if _MALLOC_TRIM is None:
        return False
    return _MALLOC_TRIM(0) == 1
