"""A training run that stops committing steps, told from its output while it runs (issue 63,
item 7): bench/gpu_ratio.py's swarm phase prints `READY_LINE` once its stage servers serve and
`STEP_LINE` for every step the trainer commits; `Stall` reads that output as it grows and names
the stall once no step came for `bound_s` seconds, so the bench ends the phase then instead of
waiting out its timeout (a trainer that retries without end never exits by itself). What
stopped it is in the trainer's own lines: `last_errors` keeps its last distinct warnings and
errors, which the bench prints with the stall. Only the standard library (the device check's
process reads these too)."""

from __future__ import annotations

import re
import time
from pathlib import Path

__all__ = ["READY_LINE", "STEP_LINE", "Stall", "last_errors"]

READY_LINE = "SERVERS READY"  # the phase's line once every stage server serves
STEP_LINE = "STEP "  # ... and its line per committed step: "STEP <n> loss <x> <s> s"
_ERROR = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback|[Ee]rror\b|\bfailed\b")
_STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ")  # logging's asctime


class Stall:
    """Asked every so often (`process_groups.run`'s watch): "" while the phase makes progress,
    else why it is stalled. Progress is its ready line, then each committed step; before the
    ready line only the phase's timeout bounds it (a GPU server's start is the model's)."""

    def __init__(self, log: Path, bound_s: float) -> None:
        self.log, self.bound_s = log, bound_s
        self.ready, self.steps = False, 0
        self._read, self._partial = 0, ""
        self._since = time.monotonic()

    def __call__(self) -> str:
        self._advance()
        if not self.ready or time.monotonic() - self._since < self.bound_s:
            return ""
        after = f"step {self.steps - 1}" if self.steps else "the stage servers were ready"
        return f"stalled: no committed step in {self.bound_s:.0f} s after {after}"

    def _advance(self) -> None:
        try:
            with open(self.log, "rb") as f:
                f.seek(self._read)
                data = f.read()
        except OSError:
            return
        self._read += len(data)
        lines = (self._partial + data.decode("utf-8", "replace")).split("\n")
        self._partial = lines.pop()  # a line not yet ended waits for its end
        for line in lines:
            if line.startswith(READY_LINE):
                self.ready, self._since = True, time.monotonic()
            elif line.startswith(STEP_LINE):
                self.steps, self._since = self.steps + 1, time.monotonic()


def last_errors(text: str, count: int = 8) -> list[str]:
    """The last `count` distinct warning and error lines of `text`, oldest first: a trainer
    that retries prints the same failure many times, and the last ones say why it stopped."""
    seen: dict[str, str] = {}
    for line in text.splitlines():
        if _ERROR.search(line):
            key = _STAMP.sub("", line.strip())
            seen.pop(key, None)
            seen[key] = line.rstrip()
    return list(seen.values())[-count:]
