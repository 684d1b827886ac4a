"""A bench's parts as process groups that leave nothing behind (issue 63, item 8).

A part (bench/gpu_check.py) or a phase (bench/gpu_ratio.py) starts stage servers, a trainer,
pytest's children: `subprocess.run(timeout=)` kills only the child it started, and the servers
it left held the device for the part after it. Here each one runs as a group of its own, a new
session (`SESSION`, a check's parts) or a new process group inside the caller's session
(`GROUP`, a part's phases, so that the part's session still holds them). It ends as a whole:
at its timeout, when its `watch` says it stalled, and whenever its leader exits with anything
of it still running: SIGTERM to every member (a stage server's shutdown frees what it holds),
SIGKILL after `grace`, and the members reaped. This process is a child subreaper (Linux), so
a member orphaned by its parent's death is reparented to it, not to init, and reaped here.

`settle` is the check before the next part: on a CUDA device, its used memory (nvidia-smi)
polled until it is back within `tolerance` of where it was before the part, for at most a
bound; on a CPU, what counts is that no process of the group is left. Either way it says so in
one line, printed by the caller. Only the standard library: the device check's own process
touches no GPU and survives a broken torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

__all__ = [
    "Ended",
    "Kind",
    "become_subreaper",
    "device_memory_mib",
    "end",
    "members",
    "run",
    "settle",
]

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
POLL_S = 0.2
GRACE_S = 5.0  # SIGTERM to SIGKILL: a stage server's own shutdown is bounded by its grace
REAP_S = 10.0  # SIGKILLed members are gone within this (uninterruptible sleep aside)
SETTLE_S = 30.0  # the device's memory is back within this once its processes are gone
TOLERANCE_MIB = 256  # the driver's own bookkeeping moves by a few MiB; a server holds GiBs


class Kind(enum.Enum):
    SESSION = "session"  # a session of its own: everything it starts, sub-groups too
    GROUP = "group"  # a process group of its own, in the caller's session


@dataclass(frozen=True)
class Ended:
    """How a group ended: its leader's exit status (-9 when it was ended here), why it was
    ended here ("" when it exited by itself), how many of its processes were still running
    when its leader exited by itself (ended here too), and what would not end (pids)."""

    code: int
    why: str
    stray: int
    left: tuple[int, ...]
    seconds: float

    @property
    def stopped(self) -> bool:
        return bool(self.why)


def become_subreaper() -> bool:
    """Orphaned descendants come to this process (reaped by `end`); False off Linux."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _stat(pid: str) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgid, sid) of /proc/PID/stat; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[2]), int(fields[3])


def members(leader: int, kind: Kind) -> list[int]:
    """The live processes (zombies aside) of `leader`'s session or group."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        stat = _stat(pid)
        if stat is None or stat[0] in ("Z", "X"):
            continue
        if (stat[3] if kind is Kind.SESSION else stat[2]) == leader:
            found.append(int(pid))
    return found


def _signal_all(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _reap_orphans(leader: int, kind: Kind) -> None:
    """Reap the exited members of `leader`'s group that were reparented to this process: only
    theirs, and never the leader, whose `Popen` reaps it (a part beside this one, in a thread of
    the check, waits for its own leader: reaping it here would lose its exit status)."""
    me = os.getpid()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        stat = _stat(pid)
        if stat is None or stat[0] != "Z" or stat[1] != me or int(pid) == leader:
            continue
        if (stat[3] if kind is Kind.SESSION else stat[2]) == leader:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(pid), os.WNOHANG)


def end(proc: subprocess.Popen[bytes], kind: Kind, grace: float = GRACE_S) -> tuple[int, ...]:
    """End `proc`'s group: SIGTERM to each member, SIGKILL after `grace` s, the leader and the
    orphans reaped. The pids still alive after that (none, but for a process stuck in the
    kernel)."""
    leader = proc.pid
    _signal_all(members(leader, kind), signal.SIGTERM)
    deadline = time.monotonic() + grace
    while members(leader, kind) and time.monotonic() < deadline:
        _reap_orphans(leader, kind)
        time.sleep(POLL_S)
    _signal_all(members(leader, kind), signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(REAP_S)
    deadline = time.monotonic() + REAP_S
    while members(leader, kind) and time.monotonic() < deadline:
        _reap_orphans(leader, kind)
        time.sleep(POLL_S)
    _reap_orphans(leader, kind)
    return tuple(members(leader, kind))


def run(
    cmd: Sequence[str],
    *,
    out: IO[str],
    timeout: float,
    kind: Kind,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    watch: Callable[[], str] | None = None,
) -> Ended:
    """`cmd` as a group of its own (`kind`), its output into `out`, until it exits, `timeout`
    seconds pass or `watch` (asked every `POLL_S`) names a reason to stop it; then `end`ed,
    whatever of it is still running."""
    started = time.monotonic()
    proc = subprocess.Popen(
        list(cmd),
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=cwd,
        start_new_session=kind is Kind.SESSION,
        process_group=0 if kind is Kind.GROUP else None,
    )
    why = ""
    while proc.poll() is None:
        if time.monotonic() - started >= timeout:
            why = f"timed out after {timeout:.0f} s"
        elif watch is not None:
            why = watch()
        if why:
            break
        time.sleep(POLL_S)
    stray = [] if why else members(proc.pid, kind)
    left = end(proc, kind) if why or stray else ()
    code = -9 if why else int(proc.returncode)
    return Ended(code, why, len(stray), left, time.monotonic() - started)


def device_memory_mib(device: str) -> int | None:
    """Used memory of CUDA `device` (cuda:N) by nvidia-smi, MiB; None on a CPU or without it.
    N is torch's index: CUDA_VISIBLE_DEVICES maps it to nvidia-smi's."""
    smi = shutil.which("nvidia-smi")
    if smi is None or not device.startswith("cuda"):
        return None
    index = device.partition(":")[2] or "0"
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and int(index) < len(visible):
        index = visible[int(index)].strip()
    try:
        done = subprocess.run(
            [smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", index],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        return int(done.stdout.split()[0])
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def settle(
    ended: Ended,
    before: int | None,
    read: Callable[[], int | None],
    bound: float = SETTLE_S,
    tolerance: int = TOLERANCE_MIB,
) -> tuple[bool, str]:
    """Whether the next part may start, and the line that says why: nothing of the group left
    (`ended.left`), and the device's used memory (`read`, MiB) back within `tolerance` of
    `before`, polled for at most `bound` seconds. Without a reading (a CPU) the processes are
    the check."""
    if ended.left:
        pids = ", ".join(map(str, ended.left))
        return False, f"left behind: processes {pids} would not end"
    # Processes its leader left running were ended above: said, and the memory still checked.
    left = f"processes it left running: {ended.stray} (ended)" if ended.stray else "no process"
    if before is None:
        return True, f"left behind: {left}"
    started = time.monotonic()
    now = read()
    while now is not None and now > before + tolerance and time.monotonic() - started < bound:
        time.sleep(POLL_S)
        now = read()
    waited = time.monotonic() - started
    if now is None:
        return False, f"left behind: {left}; device memory unread (was {before} MiB)"
    if now > before + tolerance:
        return False, (
            f"left behind: {left}, and device memory {now} MiB after {waited:.0f} s, "
            f"not back to {before} MiB (+{tolerance})"
        )
    return True, f"left behind: {left}; device memory back to {now} MiB ({before} before)"
