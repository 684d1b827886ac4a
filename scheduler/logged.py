"""An error logged instead of raised: one job's failure (to record its end, to withdraw its
assignments, to delete it) must not take the scheduler, and every other job, down with it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

__all__ = ["logged"]


@contextlib.contextmanager
def logged(log: logging.Logger, what: str) -> Iterator[None]:
    """Log an exception to `log` (with `what` it stopped) instead of raising it."""
    try:
        yield
    except Exception:
        log.exception("%s", what)
