"""py-spy on the stage servers of a bench's swarm run, while its timed steps run: where each
server's Python spends its wall time (its event loop, its worker thread), idle included.

py-spy samples a process from outside (it reads the process's memory: ptrace's permission, which
a container may withhold), so the run is not changed; `--nonblocking` never pauses it. Where
py-spy is missing or may not attach, the run goes on and the summary says why. On a GPU host
without a package index it comes as a carried wheel (bench/gpu_wheels.sh), installed by
bench/gpu_check.sh into the folder put first on PYTHONPATH: its program is in that folder's bin/
(pip's --target) or its wheel's scripts/ (unpacked without pip).
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["Sampling", "find", "merged", "summary"]

RATE = 50  # samples a second: a few hundred over a few timed steps, nothing a process notices
TOP = 8  # frames said of each thread
# a sample whose innermost frame is one of these was waiting: for a socket, a queue, a lock,
# the device (a CUDA event's synchronize is a C call: its Python frame is the caller's)
WAITING = re.compile(r"^(\S+\.)?(select|wait|poll|_poll_wrapper|acquire) \(|thread\.py:81\)")
# frames every sample of a thread passes through: the interpreter's, the loop's, the pool's
PLUMBING = re.compile(r"<frozen runpy>|asyncio/|threading\.py|concurrent/futures/|[a-z_]+/cli\.py")


def find() -> str | None:
    """The py-spy program: on PATH, beside this interpreter, or in a carried wheel's folder."""
    found = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if found:
        return found
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        for candidate in [
            Path(entry) / "bin" / "py-spy",
            *Path(entry or ".").glob("py_spy*.data/scripts/py-spy"),
        ]:
            if candidate.is_file():
                candidate.chmod(candidate.stat().st_mode | 0o111)
                return str(candidate)
    return None


class Sampling:
    """py-spy recording each of `pids` (name -> pid) for `seconds`, raw stacks into `folder`."""

    def __init__(self, pids: dict[str, int], seconds: float, folder: Path) -> None:
        self.files: dict[str, Path] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.why = ""
        program = find()
        if program is None:
            self.why = "py-spy not found (bench/gpu_wheels.sh carries its wheel)"
            return
        for name, pid in pids.items():
            path = folder / f"py-spy-{name.replace(' ', '')}.txt"
            cmd = [program, "record", "--pid", str(pid), "--nonblocking", "--idle", "--threads"]
            cmd += ["--rate", str(RATE), "--duration", str(max(1, round(seconds)))]
            cmd += ["--format", "raw", "--output", str(path)]
            log = open(folder / f"py-spy-{name.replace(' ', '')}.log", "wb")  # noqa: SIM115
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
            self.files[name] = path

    def finish(self, timeout: float = 20.0) -> None:
        """Wait for the recordings (each ends at its duration), then end any left."""
        for p in self.procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def merged(files: dict[str, Path], into: Path) -> Path:
    """The processes' raw stacks in one file, each stack under its process's name (one
    flame graph of them all: flamegraph.pl, speedscope)."""
    with open(into, "w", encoding="utf-8") as out:
        for name, path in files.items():
            if path.exists():
                for line in path.read_text(errors="replace").splitlines():
                    out.write(f"{name};{line}\n")
    return into


def summary(name: str, path: Path) -> list[str]:
    """Each thread of a process (`--threads`: its event loop is MainThread, its worker is named
    by its stage): its samples, the share it waited (its innermost frame a wait), and the frames
    its other samples were in, inclusive, the most first."""
    if not path.exists():
        log = path.with_suffix(".log")
        said = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
        return [f"{name}: no samples ({said[0] if said else 'py-spy wrote nothing'})"]
    threads: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    totals: collections.Counter[str] = collections.Counter()
    waits: collections.Counter[str] = collections.Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not count.isdigit() or len(frames) < 2:
            continue
        thread = frames[0].partition(": ")[2] or frames[0]  # "thread (tid): name"
        totals[thread] += int(count)
        if WAITING.search(frames[-1]) or frames[-1].startswith("Thread.run ("):  # in C: gRPC's poll
            waits[thread] += int(count)
            continue
        for frame in dict.fromkeys(frames[1:]):  # inclusive: each frame once a sample
            threads[thread][frame] += int(count)
    lines = [f"{name}: py-spy, by thread: samples, waiting %, then where the rest went"]
    for thread, total in totals.most_common():
        lines.append(f"  {thread}: {total} samples, {100 * waits[thread] / total:.0f}% waiting")
        telling = [(f, n) for f, n in threads[thread].most_common() if not PLUMBING.search(f)]
        for frame, n in telling[:TOP]:
            lines.append(f"    {100 * n / total:5.1f}% {frame}")
    return lines
