"""What a long-running process says at the default log level (WARNING, `swarm --log-level`):
besides warnings and errors, each role's few INFO lines that say what it became or what happened
to its jobs (a stage server measured, assigned, serving, moved, released, stopped; a job's events
in the scheduler), once each. Per-step lines are DEBUG."""

from __future__ import annotations

import logging
from collections.abc import Iterable

__all__ = ["show_at_default"]


def show_at_default(loggers: Iterable[str]) -> None:
    """Show the INFO lines of `loggers` when the level is the default: a level above WARNING
    (`--log-level ERROR`) hides them; one below shows them anyway."""
    if logging.INFO < logging.getLogger().getEffectiveLevel() <= logging.WARNING:
        for name in loggers:
            logging.getLogger(name).setLevel(logging.INFO)
