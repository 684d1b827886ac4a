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

A trim lowers a peak by at most what is allocated beside the freed memory (a commit's sums and
buffers, about the stage's state), and costs a page fault for each freed page the next step takes
again. On a small stage the freed memory is the step's own activations, many times its state: the
next step's compute peaks on them anyway, and taking them back costs more than the commit adds
(4 stage servers of a d256 GPT, 200-340 MiB freed each beside 6 MiB of state: three times the
page faults, 0.93x the samples/s). So a caller that says what it allocates beside (`beside`)
gives back only when that is at least a quarter of what the arenas hold free.
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


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (2.33+): the arenas' totals in bytes."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _load_free_bytes() -> Callable[[], int] | None:
    """The bytes glibc's arenas hold free (`mallinfo2().fordblks`), or None where it cannot say."""
    try:
        call = ctypes.CDLL(ctypes.util.find_library("c")).mallinfo2
    except (OSError, AttributeError, TypeError):
        return None
    call.argtypes, call.restype = [], _MallInfo2
    return lambda: int(call().fordblks)


_MALLOC_TRIM = _load_malloc_trim()
_FREE_BYTES = _load_free_bytes()
# Give back only when what is allocated beside is at least this share of the arenas' free bytes.
WORTH = 0.25


def give_back(beside: int | None = None) -> bool:
    """Return the freed memory of every malloc arena to the system; whether any was returned
    (False where the C library cannot, or when not worth it). With `beside` (the bytes the caller
    is about to allocate beside the freed memory), only when `beside` is at least `WORTH` of the
    arenas' free bytes (see above); where glibc cannot say those, always. It takes the arenas'
    locks while it runs: call it where no allocation-heavy work runs beside it (a replica's
    worker, before a commit)."""
    if _MALLOC_TRIM is None:
        return False
    if beside is not None and _FREE_BYTES is not None and beside < WORTH * _FREE_BYTES():
        return False
    return _MALLOC_TRIM(0) == 1
