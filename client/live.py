"""`swarm status JOB` and its live form, `--watch`: the job's state, step, loss and speed (over a
recent window: zero in a stall; an ended job's is its mean and it shows how long it took), what it
waits for and for how long, its warnings, each stage's replicas with their throughput, path
(direct, via its relay, or UNREACHABLE with the remedy, as the scheduler's dial-back found it),
measured link rates and state (a replica counts once its join succeeded; until then it is
joining, with what it waits for), the bytes per token that crossed each boundary each way
(`client.boundaries`),
and its recent events: the scheduler's history of the job (joins, leaves and why, restarts, moves,
stalls, rollbacks, its end), from the start. Against a scheduler that keeps no history, watching
shows the events seen between two looks instead.

A terminal gets each frame drawn over the last in place (cursor home, every line cleared to its
end, the rest of the screen cleared below), so nothing flickers; other outputs get one plain
frame per change. A scheduler that does not answer (a network blip, a restart) does not end the
view: "scheduler unreachable since HH:MM:SS (N s): retrying" is shown above the last frame until
it answers (`client.outage`).
"""

from __future__ import annotations

import asyncio
import math
import time
import tomllib
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TextIO

from client.boundaries import boundary_rows
from client.outage import Outage
from swarm.errors import ConfigError
from swarm.job.config import parse_job
from swarm.job.schema import TrustConfig
from swarm.job.states import TERMINAL_PROTO, peer_state_name
from swarm.job.states import job_state_name as state_name
from swarm.ops.printable import shown
from swarm.ops.progress import duration_text
from swarm.policy.window import window
from swarm.proto import scheduler_pb2
from swarm.proto.control_pb2 import (
    PEER_STATE_JOINING,
    PEER_STATE_SERVING,
    PEER_STATE_STANDBY,
    REACHABILITY_DIRECT,
    REACHABILITY_RELAYED,
    REACHABILITY_UNREACHABLE,
)

__all__ = [
    "LiveView",
    "event_lines",
    "event_lines_of",
    "events",
    "loss_text",
    "path_text",
    "rates_text",
    "rounds_lines",
    "shown",
    "status_lines",
    "table",
    "terminal_frame",
    "watch_status",
]

HOME, CLEAR_LINE, CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"


def loss_text(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.4f}"


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def _clock_time(unix: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(unix))


def _layers(layers: list[int]) -> str:
    if not layers:
        return "no layers"
    return f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"


def event_lines_of(events: Iterable[scheduler_pb2.JobEvent]) -> list[str]:
    """Each event as a line, with its time."""
    return [f"{_clock_time(e.time)} {shown(e.text)}" for e in events]


def event_lines(s: scheduler_pb2.JobStatus, keep: int) -> list[str]:
    """The job's newest `keep` events, oldest first, each with its time."""
    return event_lines_of(s.events[-keep:]) if keep else []


def status_lines(
    s: scheduler_pb2.JobStatus, now: float | None = None, events: int = 10
) -> list[str]:
    """The job as `swarm status` prints it; `now` (unix seconds) counts how long it has waited;
    `events`: how many of its newest events to list (0: none)."""
    now = time.time() if now is None else now
    ended = s.state in TERMINAL_PROTO
    speed = f"{s.samples_per_second:.1f} samples/s"
    lines = [
        f"job      {shown(s.job)} ({shown(s.name)})",
        f"state    {state_name(s.state)}"
        + (f" after {duration_text(s.updated - s.created)}" if ended and s.created else ""),
        f"step     {s.step}/{s.steps}",
        f"loss     {loss_text(s.loss)}",
        f"speed    {speed}" + (" (mean over its steps)" if ended else ""),
    ]
    if s.HasField("val_loss"):
        lines.insert(4, f"val loss {loss_text(s.val_loss)} (after {s.val_step} steps)")
    lines += rounds_lines(s, now)
    lines += trust_lines(s) + ([] if ended else window_lines(s))
    if s.message:
        waited = (
            f" (for {duration_text(now - s.waiting_since)}, since {_clock_time(s.waiting_since)})"
            if s.waiting_since
            else ""
        )
        lines.append(f"message  {shown(s.message)}{waited}")
    lines += [f"error    {shown(s.error)}"] if s.error else []
    lines += [f"warning  {shown(w)}" for w in s.warnings]
    for st in s.stages:
        layers = _layers(list(st.layers))
        joining = sum(r.state == PEER_STATE_JOINING for r in st.replicas)
        standing = sum(r.state == PEER_STATE_STANDBY for r in st.replicas)
        lines.append(
            f"stage {st.stage} ({layers}): {_counted(st)} replica(s)"
            + (f", {joining} joining" if joining else "")
            + (f", {standing} standby" if standing else "")
        )
        rows = [["  PEER", "DEVICE", "SAMPLES/S", "PATH", "UP/DOWN", "HOLDS", "STATE"]]
        rows += [
            [
                f"  {shown(r.peer)}",
                shown(r.device),
                f"{r.samples_per_second:.1f}",
                path_text(r),
                rates_text(r.upload_bytes_per_second, r.download_bytes_per_second),
                str(r.activation_capacity) if r.activation_capacity else "-",
                _state_text(r, now),
            ]
            for r in st.replicas
        ]
        lines += table(rows).splitlines() if st.replicas else []
        lines += [  # why, and what fixes it: too long for a column
            f"    {shown(r.peer)} is UNREACHABLE: {shown(r.reachability_detail)}"
            for r in st.replicas
            if r.reachability == REACHABILITY_UNREACHABLE and r.reachability_detail
        ]
    if rows := boundary_rows(s):
        lines += ["boundaries (bytes per token sent, as encoded):", *table(rows).splitlines()]
    if events and s.events:
        lines += ["", "events:", *(f"  {e}" for e in event_lines(s, events))]
    return lines


def _state_text(r: scheduler_pb2.Replica, now: float) -> str:
    """A replica's state as known: what a joining one waits for, and since when a serving one
    has sent no load report (issue 68 item 3: not `serving` through a pulled router)."""
    if r.state == PEER_STATE_STANDBY and r.joining.startswith("standby"):
        text = shown(r.joining)  # "standby for stage K, N steps behind (following P)"
    else:
        text = peer_state_name(r.state) + (f": {shown(r.joining)}" if r.joining else "")
    if r.silent_since:
        text += f", silent since {_clock_time(r.silent_since)} ({now - r.silent_since:.0f} s)"
    return text


def path_text(r: scheduler_pb2.Replica) -> str:
    """How calls reach a replica, as the scheduler's dial-back found it: "direct", "via RELAY",
    "UNREACHABLE"; "-" before its first dial-back (or from a scheduler that does none)."""
    if r.reachability == REACHABILITY_DIRECT:
        return "direct"
    if r.reachability == REACHABILITY_RELAYED:
        return f"via {shown(r.relay)}"
    return "UNREACHABLE" if r.reachability == REACHABILITY_UNREACHABLE else "-"


def rates_text(up: float, down: float) -> str:
    """Measured link rates (bytes/s) as "100/20 Mbit/s"; "?" for one not known, "-" for none."""
    if up <= 0 and down <= 0:
        return "-"

    def mbit(rate: float) -> str:
        if rate <= 0 or not math.isfinite(rate):
            return "?"
        value = rate * 8 / 1e6
        return f"{value:.0f}" if value >= 10 else f"{value:.1f}"

    return f"{mbit(up)}/{mbit(down)} Mbit/s"


def _size_text(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def rounds_lines(s: scheduler_pb2.JobStatus, now: float) -> list[str]:
    """The job's rounds (a rule whose pools meet in rounds, while it trains): the rule, the
    round under way, the steps to the next average, and the last average's time (how long it
    took, how long ago) and bytes (what its pools sent each other, before compression)."""
    if not s.HasField("rounds"):
        return []
    r = s.rounds
    each = _steps_text(r.round_steps)
    line = f"rounds   {shown(r.rule)}, round {r.round}/{r.rounds} ({each} each), "
    if r.next_average_in:
        line += f"next average in {_steps_text(r.next_average_in)}"
    else:
        line += "no average left"
    if not r.last_at:
        return [line + "; no average yet"]
    took, ago = _took_text(r.last_seconds), duration_text(now - r.last_at)
    return [line + f"; last average took {took}, {ago} ago, {_size_text(r.last_bytes)} moved"]


def trust_lines(s: scheduler_pb2.JobStatus) -> list[str]:
    """What the job's audits cost (docs/jobs.md "Trust": `[trust] audit_fraction` of the stage
    compute for the answers' audit and as much again for the contributions', on either plane)
    and the peers banned for lying (its `ban` events); [] when it audits
    nothing and banned nobody. The measured cost is the metrics'
    (`swarm_coordinator_audit_runs_total` over `swarm_coordinator_stage_runs_total`)."""
    try:
        spec = tomllib.loads(s.spec) if s.spec else {}
    except tomllib.TOMLDecodeError:
        spec = {}
    fraction = float(spec.get("trust", {}).get("audit_fraction", TrustConfig().audit_fraction))
    banned = [e.text.split(" ", 2)[1] for e in s.events if e.kind == "ban" and " " in e.text]
    if not fraction and not banned:
        return []
    # the contributions' audit (either plane, stages of three or more) spends as much again
    cost, also = min(2 * fraction, 2.0), " and contributions"
    line = (
        f"audits   {fraction * 100:.3g}% of each stage's microbatches re-executed{also}: about "
        f"+{cost * 100:.3g}% stage compute"
        if fraction
        else "audits   none (audit_fraction = 0)"
    )
    return [line + (f"; banned for lying: {', '.join(banned)}" if banned else "")]


def window_lines(s: scheduler_pb2.JobStatus) -> list[str]:
    """The microbatches a trainer of the job keeps in flight, as each sizes it from the members
    its leases show (`swarm.policy.window`: the replicas serving, with what each said it holds,
    the HOLDS column); [] without a job file to read it from."""
    try:
        job = parse_job(s.spec, Path(s.base_dir or "/"), s.name or "job", check_data=False)
    except ConfigError:
        return []
    held = [
        [r.activation_capacity for r in st.replicas if r.state == PEER_STATE_SERVING]
        for st in s.stages
    ]
    how = "auto: by what the stages hold" if job.runtime.max_in_flight == "auto" else "fixed"
    return [f"window   {window(job, held)} microbatches in flight a trainer ({how})"]


def _steps_text(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def _took_text(seconds: float) -> str:
    """How long an average took: `840ms`, `2.3s`, `1m15s`."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    return f"{seconds:.1f}s" if seconds < 60 else duration_text(seconds)


def _counted(stage: scheduler_pb2.StageStatus) -> int:
    """The replicas of `stage` that count: those serving (their join succeeded)."""
    return sum(r.state == PEER_STATE_SERVING for r in stage.replicas)


def _where(s: scheduler_pb2.JobStatus) -> dict[str, int]:
    """Where each replica is, once it joined (one still joining, or standing by, has not) or
    while it drains."""
    return {
        shown(r.peer): st.stage
        for st in s.stages
        for r in st.replicas
        if r.state not in (PEER_STATE_JOINING, PEER_STATE_STANDBY)
    }


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
        """The view of `s`: with the job's own newest events, or (a scheduler that keeps no
        history) with what changed since the last frame."""
        lines = status_lines(s, now=self.clock(), events=0)
        if s.events:
            recent = event_lines(s, self.recent.maxlen or 0)
        else:
            if self.last is not None:
                stamp = _clock_time(self.clock())
                self.recent.extend(f"{stamp} {e}" for e in events(self.last, s))
            recent = list(self.recent)
        self.last = s
        if recent:
            lines += ["", "recent events:", *(f"  {e}" for e in recent)]
        return "\n".join(lines)


def terminal_frame(text: str) -> str:
    """`text` drawn over the previous frame in place: no blank screen between two frames."""
    return HOME + "".join(f"{line}{CLEAR_LINE}\n" for line in text.splitlines()) + CLEAR_BELOW


async def watch_status(
    get: Callable[[Callable[[Outage], None]], Awaitable[scheduler_pb2.JobStatus]],
    out: TextIO,
    *,
    interval_s: float,
    tty: bool,
    done: Callable[[scheduler_pb2.JobStatus], bool],
) -> scheduler_pb2.JobStatus:
    """Redraw the job's view every `interval_s` until `done(status)`; returns the last status.
    `get(unreachable)` is the job's status, asked again while the scheduler does not answer
    (`SchedulerClient.get_through`), calling `unreachable(outage)` after each unanswered ask:
    a terminal shows the outage on top of the last frame, in place; other outputs say it once
    per outage, and draw the frame again once the scheduler answers."""
    view, drawn, silent = LiveView(), "", False

    def unreachable(outage: Outage) -> None:
        nonlocal silent
        if tty:
            out.write(terminal_frame(f"{outage.text()}\n{drawn}"))
        elif not silent:
            out.write(outage.text() + "\n\n")
        silent = True
        out.flush()

    if tty:
        out.write(HIDE_CURSOR + HOME + CLEAR_BELOW)
    try:
        while True:
            status = await get(unreachable)
            text = view.frame(status)
            if tty:
                out.write(terminal_frame(text))
            elif text != drawn or silent:
                out.write(text + "\n\n")
            drawn, silent = text, False
            out.flush()
            if done(status):
                return status
            await asyncio.sleep(interval_s)
    finally:
        if tty:
            out.write(SHOW_CURSOR)
            out.flush()
