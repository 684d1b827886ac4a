"""A page of the job store's listing (`JobStore.page`): its cursor, a position (created, rowid)
rather than an offset, so that jobs created or deleted meanwhile shift nothing; and its byte
budget, so that records stored before their fields were bounded cannot make a page no client can
receive."""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Callable
from typing import TypeVar

from swarm.errors import InvalidArgument

__all__ = ["page_of", "position"]

R = TypeVar("R")

# A listed job's bytes besides its text columns (numbers, field tags), for a page's budget.
_LISTED_OVERHEAD = 128
_TEXT = ("id", "name", "base_dir", "error", "message", "submitter")


def position(cursor: str) -> tuple[float, int]:
    """A page cursor's (created, rowid); InvalidArgument for one this store did not give."""
    created, _, row = cursor.partition("/")
    try:
        found = float.fromhex(created), int(row)
    except (ValueError, OverflowError):  # "0x1p2000": past a float's range
        found = (math.nan, 0)
    # a rowid is SQLite's 64-bit integer: a larger one overflowed at the query, as a bug
    if not math.isfinite(found[0]) or not 0 <= found[1] < 1 << 63:
        raise InvalidArgument(
            f"page_token {cursor[:80]!r} is not one this scheduler gave; list again without one"
        )
    return found


def page_of(
    rows: sqlite3.Cursor, limit: int, budget: int | None, record: Callable[[sqlite3.Row], R]
) -> tuple[list[R], str]:
    """Up to `limit` of `rows` (asked for `limit + 1`: is there a next page?) as records, and the
    next page's cursor ("" when none is left). With a `budget`, the page also ends after the row
    that takes its text to `budget` bytes or more: it holds one row at least, and rows past the
    end are never read."""
    records: list[R] = []
    used, last = 0, None
    try:
        for r in rows:  # read one at a time: a page over its budget reads no more
            if last is not None and (len(records) == limit or (budget and used >= budget)):
                return records, f"{last['created'].hex()}/{last['position']}"
            records.append(record(r))
            used += _LISTED_OVERHEAD + sum(len(r[k].encode()) for k in _TEXT)
            last = r
    finally:
        rows.close()  # the read ends here, not when the cursor is collected
    return records, ""
