"""The garbage collector held off while a test judges what is still referenced: whatever only a
cycle's collection would free then shows as held, as it stays held in a process until the
collector's next pass (which may be minutes away, with a large heap)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_off() -> Iterator[None]:
    """A collection first (what was garbage before goes), then none until the block ends."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
