"""`swarm status JOB` and its live form, `--watch`: the job's state, step, loss and speed, each
stage's replicas with their throughput and state, and (watching) the recent events seen between
two looks: replicas that joined, left or moved, rollbacks, state changes, new messages.

A terminal gets each frame drawn over the last in place (cursor home, every line cleared to its
end, the rest of the screen cleared below), so nothing flickers; other outputs get one plain
frame per change.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TextIO

from swarm.job.states import job_state_name as state_name
from swarm.job.states import peer_state_name
from swarm.proto import scheduler_pb2

__all__ = [
    "LiveView",
    "events",
    "loss_text",
    "status_lines",
    "table",
    "terminal_frame",
    "watch_status",
]

HOME, CLEAR_LINE, CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"


def shown(text: str) -> str:
    """`text` as a terminal may print it: what peers name themselves and what messages quote
    reaches the operator's screen, so a control character (an escape sequence that clears the
    screen or retitles the terminal, a newline that draws a line of its own) is written out as
    its escape instead."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def loss_text(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.4f}"


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def status_lines(s: scheduler_pb2.JobStatus) -> list[str]:
    lines = [
        f"job      {shown(s.job)} ({shown(s.name)})",
        f"state    {state_name(s.state)}",
        f"step     {s.step}/{s.steps}",
        f"loss     {loss_text(s.loss)}",
        f"speed    {s.samples_per_second:.1f} samples/s",
    ]
    if s.HasField("val_loss"):
        lines.insert(4, f"val loss {loss_text(s.val_loss)} (after {s.val_step} steps)")
    lines += [f"message  {shown(s.message)}"] if s.message else []
    lines += [f"error    {shown(s.error)}"] if s.error else []
    for st in s.stages:
        layers = f"layers {st.layers[0]}-{st.layers[-1]}" if st.layers else "no layers"
        lines.append(f"stage {st.stage} ({layers}): {len(st.replicas)} replica(s)")
        rows = [["  PEER", "DEVICE", "SAMPLES/S", "STATE"]]
        rows += [
            [
                f"  {shown(r.peer)}",
                shown(r.device),
                f"{r.samples_per_second:.1f}",
                peer_state_name(r.state),
            ]
            for r in st.replicas
        ]
        lines += table(rows).splitlines() if st.replicas else []
    return lines


def _where(s: scheduler_pb2.JobStatus) -> dict[str, int]:
    return {shown(r.peer): st.stage for st in s.stages for r in st.replicas}


def events(before: scheduler_pb2.JobStatus, after: scheduler_pb2.JobStatus) -> list[str]:
    """What changed between two looks at a job, in words."""
    said: list[str] = []
    if after.state != before.state:
        said.append(f"job {state_name(before.state)} -> {state_name(after.state)}")
    if after.step < before.step:
        said.append(f"rolled back from step {before.step} to step {after.step}")
    was, now = _where(before), _where(after)
    for peer in sorted(was.keys() | now.keys()):
        if peer not in now:
            said.append(f"{peer} left stage {was[peer]} (killed, stopped or moving)")
        elif peer not in was:
            said.append(f"{peer} joined stage {now[peer]}")
        elif was[peer] != now[peer]:
            said.append(f"{peer} moved from stage {was[peer]} to stage {now[peer]}")
    if after.message and after.message != before.message:
        said.append(shown(after.message))
    if after.error and after.error != before.error:
        said.append(f"error: {shown(after.error)}")
    return said


class LiveView:
    """Frames of one job's status with the last `keep` events, each stamped with its time."""

    def __init__(self, keep: int = 8, clock: Callable[[], float] = time.time) -> None:
        self.recent: deque[str] = deque(maxlen=keep)
        self.last: scheduler_pb2.JobStatus | None = None
        self.clock = clock

    def frame(self, s: scheduler_pb2.JobStatus) -> str:
        """The view of `s`, after taking in what changed since the last frame."""
        if self.last is not None:
            stamp = time.strftime("%H:%M:%S", time.localtime(self.clock()))
            self.recent.extend(f"{stamp} {e}" for e in events(self.last, s))
        self.last = s
        lines = status_lines(s)
        if self.recent:
            lines += ["", "recent events:", *(f"  {e}" for e in self.recent)]
        return "\n".join(lines)


def terminal_frame(text: str) -> str:
    """`text` drawn over the previous frame in place: no blank screen between two frames."""
    return HOME + "".join(f"{line}{CLEAR_LINE}\n" for line in text.splitlines()) + CLEAR_BELOW


async def watch_status(
    get: Callable[[], Awaitable[scheduler_pb2.JobStatus]],
    out: TextIO,
    *,
    interval_s: float,
    tty: bool,
    done: Callable[[scheduler_pb2.JobStatus], bool],
) -> scheduler_pb2.JobStatus:
    """Redraw the job's view every `interval_s` until `done(status)`; returns the last status."""
    view, shown = LiveView(), ""
    if tty:
        out.write(HIDE_CURSOR + HOME + CLEAR_BELOW)
    try:
        while True:
            status = await get()
            text = view.frame(status)
            if tty:
                out.write(terminal_frame(text))
            elif text != shown:
                out.write(text + "\n\n")
            shown = text
            out.flush()
            if done(status):
                return status
            await asyncio.sleep(interval_s)
    finally:
        if tty:
            out.write(SHOW_CURSOR)
            out.flush()
