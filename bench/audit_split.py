"""What a swarm run's CPU went to, split by what audits spend (issue 69, item 4): each process's
threads' CPU seconds (utime + stime from /proc, `bench.cpu_split.threads`) over a window, each
thread's share split by where py-spy found it running over the same window.

- **re-execution**: a stage server's re-execute path (the servicer's Forward, Backward and
  ForwardBackward, which on the push plane only audits call, and the worker's `redoing`), and the
  trainer's calls for it (`client.audit.reexecute`);
- **digests**: `swarm.wire.digest` wherever it runs (a record's digester thread, the trainer's
  checks of what it fetched and sent);
- **records kept**: a push's record made and filled (`push_records`, `push._record`), and the
  parameters kept for a late re-execution (`PriorParams.keep`; not its lookups, which every
  step's work passes through);
- **records fetched**: the servicer's `Record` (commitments and tensors), the trainer's asks
  (`push_audit._commitment`, `push_fetch.fetched_record`, the client's `record`);
- **trainer's audits**: the rest of `client.audit` (drawing, comparing, reporting);
- **rest**: everything else, the training itself, and every thread py-spy never saw running
  (gRPC's own threads, in C).

A sample is the first of these its stack shows, in that order: a digest taken while a record is
fetched is a digest. py-spy samples only threads that run (`record` without `--idle`); on a
loaded machine a thread waiting for a core may be sampled as running, which blurs a thread's
split between its parts, not its CPU, which /proc gives.
"""

from __future__ import annotations

import collections
import re
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from bench import spy
from bench.cpu_split import threads

__all__ = ["PARTS", "Spied", "part_of", "samples", "split_of"]

RATE = 25  # samples a second, each of 13 processes: little for py-spy to take from 2 cores

PARTS = (
    "re-execution",
    "digests",
    "records kept",
    "records fetched",
    "trainer's audits",
    "rest",
)

# Each part's frames (py-spy's "qualname (path:line)"), the first part matched wins
_RULES = (
    ("digests", re.compile(r"(^|\.)(digest|sent_digest) \([^)]*(swarm/wire/digest|push_records)")),
    (
        "re-execution",
        re.compile(
            r"(^|\.)(Forward|Backward|ForwardBackward)( |\.<locals>)[^;]*stage_server/servicer\.py"
            r"|(^|\.)redoing \([^)]*stage_server/replica/answering\.py"
            r"|\([^)]*client/audit/reexecute\.py"
        ),
    ),
    (
        "records fetched",
        re.compile(
            r"(^|\.)Record( |\.<locals>)[^;]*stage_server/servicer\.py"
            r"|\([^)]*client/audit/push_fetch\.py"
            r"|(^|\.)_commitment \([^)]*client/audit/push_audit\.py"
            r"|(^|\.)record \([^)]*swarm/rpc/stage_client\.py"
        ),
    ),
    (
        "records kept",
        re.compile(
            r"\([^)]*stage_server/replica/push_records\.py"
            r"|(^|\.)_record \([^)]*stage_server/replica/push\.py"
            # its copy of the parameters, not the lookups every step passes through
            r"|(^|\.)(keep|pooled|recorded) \([^)]*stage_server/replica/prior_params\.py"
        ),
    ),
    ("trainer's audits", re.compile(r"\([^)]*client/audit/")),
)


def part_of(frames: list[str]) -> str:
    """The part (`PARTS`) a sampled stack (outermost frame first) counts to."""
    for part, rule in _RULES:
        if any(rule.search(frame) for frame in frames):
            return part
    return "rest"


def samples(raw: str) -> dict[int, collections.Counter[str]]:
    """py-spy's raw output (`--threads`: each stack's first frame "thread (TID): name") as each
    thread's samples by part."""
    out: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        found = re.match(r"thread \((\d+)\)", frames[0])
        if found is None or not count.isdigit():
            continue
        out[int(found.group(1))][part_of(frames[1:])] += int(count)
    return out


def split_of(
    cpu: dict[int, float], sampled: dict[int, collections.Counter[str]]
) -> dict[str, float]:
    """A process's CPU seconds by part: each thread's (`cpu`, by TID) shared out as its samples
    (`sampled`) were; a thread never sampled running is all "rest"."""
    out = dict.fromkeys(PARTS, 0.0)
    for tid, seconds in cpu.items():
        seen = sampled.get(tid, collections.Counter())
        total = sum(seen.values())
        if not total:
            out["rest"] += seconds
            continue
        for part, n in seen.items():
            out[part] += seconds * n / total
    return out


@dataclass
class Spied:
    """The window's readings of processes (name -> pid): their threads' CPU at its start and,
    where py-spy records them (`folder`), their samples over it."""

    pids: dict[str, int]
    folder: Path | None
    before: dict[str, dict[int, float]] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    why: str = ""  # why nothing was sampled, where nothing was

    def start(self) -> None:
        """The window opens: CPU read, py-spy started on each process."""
        self.before = {name: threads(pid) for name, pid in self.pids.items()}
        program = spy.find() if self.folder is not None else None
        if self.folder is not None and program is None:
            self.why = "py-spy not found"
        if self.folder is None or program is None:
            return
        for name, pid in self.pids.items():
            cmd = [program, "record", "--pid", str(pid), "--nonblocking", "--threads"]
            cmd += ["--rate", str(RATE), "--format", "raw", "--output", str(self._raw(name))]
            log = open(self.folder / f"{name}.log", "wb")  # noqa: SIM115 (the child's now)
            self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def stop(self, steps: int) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        """The window closes: each process's CPU seconds a step over it, and (where py-spy
        sampled it) its split by part, a step."""
        after = {name: threads(pid) for name, pid in self.pids.items()}
        for p in self.procs.values():  # py-spy writes what it sampled on SIGINT, as on Ctrl-C
            p.send_signal(signal.SIGINT)
        for p in self.procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        totals, parts = {}, {}
        for name in self.pids:
            spent = {t: s - self.before[name].get(t, 0.0) for t, s in after[name].items()}
            totals[name] = sum(spent.values()) / steps
            raw = self._raw(name) if self.procs else None
            if raw is not None and raw.exists():
                split = split_of(spent, samples(raw.read_text(errors="replace")))
                parts[name] = {part: s / steps for part, s in split.items()}
        return totals, parts

    def _raw(self, name: str) -> Path:
        assert self.folder is not None
        return self.folder / f"{name}.txt"
