"""Where a step's time goes, for the benches: each process writes what it spent time on (a
stage's compute on its worker, a handover taken, a trainer's microbatch and lease calls, the
coordinator's step opening, completing and being applied), off unless asked.

Why its own record and not a profiler's: a step of swarm is spread over processes (the trainer,
the coordinator inside it, a stage server per stage), and what leaves a GPU idle is the time
between their calls, which no one process's profile shows. Each process appends one JSON line
per event to `$SWARM_TIMELINE/<pid>.jsonl`, times from `time.perf_counter()` (CLOCK_MONOTONIC on
Linux: one clock for every process of the host, so the lines of all of them merge into one
timeline); `bench/timeline_report.py` reads them back. A line is a few microseconds of work and
a step writes some tens of them, so the run measured is the run that is not.

Unset (the default), `span` and `mark` return at once: a server in production writes nothing.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from pathlib import Path
from typing import IO, Any

__all__ = ["ENV", "enabled", "mark", "now", "span"]

ENV = "SWARM_TIMELINE"  # a folder: each process appends its events to <folder>/<pid>.jsonl

_lock = threading.Lock()  # a worker thread and the event loop both write
_state: dict[str, Any] = {"key": (None, None), "file": None}  # (pid, folder) of the file


def now() -> float:
    """The timeline's clock (the compute clocks' too: `swarm.device.compute_clock`)."""
    return time.perf_counter()


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def _file() -> IO[str] | None:
    folder = os.environ.get(ENV)
    if not folder:
        return None
    key = (os.getpid(), folder)
    if _state["key"] != key:  # first use, a forked child or another folder: a file of its own
        if _state["file"] is not None and _state["key"][0] == key[0]:
            _state["file"].close()  # this process's, for a folder no longer asked for
        Path(folder).mkdir(parents=True, exist_ok=True)
        # line-buffered: a server ended by a signal still leaves every event it wrote
        path = Path(folder) / f"{key[0]}.jsonl"
        _state["file"] = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (held)
        _state["key"] = key
        atexit.register(_state["file"].close)
    return _state["file"]  # type: ignore[no-any-return]


def _write(event: dict[str, Any]) -> None:
    with _lock:
        f = _file()
        if f is not None:
            f.write(json.dumps(event, separators=(",", ":")) + "\n")


def span(name: str, start: float, end: float, **fields: Any) -> None:
    """`name` took from `start` to `end` (`now()` readings), with `fields` (small values)."""
    if os.environ.get(ENV):
        _write({"n": name, "t0": start, "t1": end, **fields})


def mark(name: str, **fields: Any) -> None:
    """`name` happened now, with `fields`."""
    if os.environ.get(ENV):
        _write({"n": name, "t0": now(), **fields})
