"""The bulk paths of a large stage against a bare gRPC stream of the same bytes, and the memory
each process takes against the state it serves, all measured in one run.

    .venv/bin/python bench/bulk.py [--params 50e6] [--reps 3] [--dir /tmp] [--json]
    .venv/bin/python bench/bulk.py --rounds-only [--pairs 3] [--steps 4] [--reps 5]

A stage of about `--params` parameters (a byte-level GPT, `[training] stages = 1`, float32,
AdamW: d_model a multiple of 64, 4 blocks, n_layers fewer when that comes closer) holds
16 bytes a parameter: its parameters, its gradient sums and AdamW's two moments ("state" below).
Every process is a fresh one started for its measurement (torch on one thread each), so each peak
RSS is its path's; where a process needs a set-up first (a training step, a state to send) its
peak is reset (`/proc/<pid>/clear_refs`) before the timed part. Rows, each as MB/s (10^6 bytes
a second, the median of `--reps` repetitions after a warm-up where one is cheap) and as a ratio
to the bare stream's MB/s in the same run:

- bare stream: the ceiling. Two processes on 127.0.0.1, one `grpc.aio` stream-stream call with
  identity serialisation (raw bytes): the sender writes the gradient's bytes (4 B a parameter)
  in 4 MiB chunks, the receiver adds each chunk into a preallocated float32 tensor
  (`torch.frombuffer` + `add_`) and answers when all came. One warm-up call first.
- bare exchange, 2 and 4 processes: a round's bytes in a round's pattern over bare streams
  (raw bytes, as the bare stream): every process at once streams each other member that
  member's part of its gradient, and the member adds it in and answers as many bytes. On a
  machine whose cores all the processes share, sending and receiving at once, this and not the
  one-way stream is the ceiling of an all-reduce; the pool rows give their ratio to it too.
- pool averaging, 2 and 4 replicas: that many processes, each a pool replica as
  `tests/support/pools.py` builds one (`PoolServicer` + `Averager` on a `grpc.aio` server, a
  `ChannelPool`) holding a seeded random float32 gradient, run `butterfly.all_reduce` together
  (chunk_bytes 4 MiB, codec none, timeout 300 s; a new round id per round; one warm-up round).
  The benchmark starts every round by writing "go" to all of them at once. Bytes: what each
  replica sends in a round, its contributions to the N-1 other owners and the sums it answers
  them, 2 (N-1)/N x the gradient's bytes; seconds: the slowest replica's (a round is over when
  it is), median over rounds. Checked: every replica's sum has the same sha256, that of
  ((g0 + g1) + g2) + ... computed here in float32 in the same order.
- state download: a real stage server (`swarm stage-server --job J --stage 0`: the standalone
  path, which installs the job's one stage at start), trained one step by the client (one
  microbatch, `ForwardBackward` + `Commit`) so that it holds AdamW's moments, then
  `StageClient.download_state(include_optimizer=True)` from a client process, as a joining
  replica copies a member (`stage_server/replica/copying.py`). Bytes: the state received (parameters
  and the two moments, 12 B a parameter).
- LoadState: that state (downloaded first, not timed) sent into a second, fresh stage server
  with `StageClient.load_state`.
- checkpoint write / read: `swarm.model.checkpoint.save_stage` of that state in a temporary
  directory under `--dir`, and `load_stage` of it, in a process of their own; the baseline rows
  write the same bytes from the tensors' own memory with one `writev` + `fsync` (each rep just
  before the checkpoint's, so that both meet the disk in the same state) and read them with one
  `read` into a buffer allocated and touched beforehand (allocating 600 MB costs about as much
  as reading it here), in the same directory. Before every read the file's pages are dropped
  from the page cache (`posix_fadvise(DONTNEED)` after the fsync), so both reads come from the
  disk. The checkpoint
  rows' notes give their ratio to the baseline (the issue's target: >= 0.8 for writes). The
  process writes `--reps` checkpoints, drops the state, then reads them back: its peak while
  writing (holding the state) and while reading (holding only what it reads) are its own.
- activation hop: a boundary of microbatch 8 x seq 1024 x d_model 1024 float32 (32 MiB) through
  stage servers' `Forward` (`StageClient.forward`, `evaluate`: no graph kept). The wire is
  isolated from compute by stages that compute next to nothing: a job of one block in three
  stages with a vocabulary of one token, served by the embedding stage (tokens in, the 32 MiB
  boundary out: a lookup and an add) and the head stage (the boundary in, logits of one value a
  position out: a LayerNorm and a d_model x 1 product); their compute, timed in the client
  process on one thread, is subtracted from the calls' time as well. Bytes: all tensor bytes in
  and out of both calls (one hop's in + out, about 64 MiB).

A step's round against the isolated one (issue 43, item 6; the target: >= 0.8 of the isolated
round's speed): the pool of 2 training the stage (below) runs on stage servers whose commits are
timed where they run (`bulk_child.py`'s `timed-stage-server`: `swarm stage-server` in a wrapper
that times `all_reduce`, the PREPARE and APPLY calls and the spill's writes, in CLOCK_MONOTONIC,
one clock for every process here). Each step's round is the slower member's `all_reduce` call;
"from the last start" runs from the later member's call to the last one's end (the wait for a
member that came later is not the round's), "apart" is that wait. Right before it, the isolated
pool of 2 runs again (`--reps` rounds), and the two make a pair: the ratio is the isolated
median / the median of the step's rounds after its first (whose channels are dialled then, as
the isolated pool's warm-up dials them). With both, the CPU seconds the process used in each
round (every thread's): on a machine that others load, CPU moves less than wall time.
`--rounds-only` runs only `--pairs` such pairs, each training `--steps` steps, and reports each
pair and the median of their ratios, with the load average before each.

Memory: the peak RSS (VmHWM) of every process of every row, against 16 B x the parameters of the
stage it works for ("state"), as `peak / state` and `(peak - bare) / state`, where `bare` is the
peak of a fresh process that imported torch and grpc and stepped an AdamW over one value
(measured in this run); and against what the process must hold to do its part ("holds": the
gradient for the stream and the pool, the state for the stage servers and the state clients, the
boundary for the hop's client).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from swarm.job.config import load_job  # noqa: E402
from swarm.local.procs import SwarmProcess, start_process  # noqa: E402
from swarm.model.transformer import stage_layout  # noqa: E402

CHILD = Path(__file__).resolve().parent / "bulk_child.py"
MiB = 1 << 20
GiB = 1 << 30
CHUNK_BYTES = 4 * MiB
POOL_TIMEOUT_S = 300.0
READY_TIMEOUT_S = 300.0
STEP_TIMEOUT_S = 1800.0  # one child's answer to one command, at --params 1e9 on two cores
LAYERS = (4, 2, 1)  # blocks of the state job, by preference
# The hop: microbatch x seq x d_model float32 = 32 MiB.
HOP = dict(microbatch=8, seq_len=1024, d_model=1024)


# --- processes ------------------------------------------------------------------------------


def peak_rss(pid: int) -> int:
    """VmHWM of `pid` in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def reset_peak(pid: int) -> None:
    """VmHWM := VmRSS (Linux >= 4.0)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


class Child:
    """A `bulk_child.py` process: JSON lines out, commands in."""

    def __init__(self, role: str, args: dict[str, Any], log_dir: Path, name: str) -> None:
        self.name, self.log_path = name, log_dir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(CHILD), role, json.dumps(args)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
            )
        self._buffer = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read(self, key: str, timeout: float = STEP_TIMEOUT_S) -> Any:
        """The value of the next line that holds `key`."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                if line.strip():
                    message = json.loads(line)
                    if key in message:
                        return message[key]
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, left))
            data = os.read(self.proc.stdout.fileno(), 1 << 16) if ready else b""
            if not data:
                why = "exited" if ready or self.proc.poll() is not None else "timed out"
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.name} {why} before {key!r}:\n{tail}")
            self._buffer += data

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def stage_server(
    job_path: Path, stage: int, log_dir: Path, name: str, times: Path | None = None
) -> SwarmProcess:
    """`swarm stage-server` of `stage`, serving; with `times`, its commits' phases timed into
    that file (`bulk_child.py`'s `timed-stage-server`, the same server in a wrapper)."""
    args = ["stage-server", "--job", str(job_path), "--stage", str(stage), "--port", "0"]
    args += ["--threads", "1"]
    if times is None:
        server = start_process(args, log_dir=log_dir, name=name)
    else:
        server = start_timed(args, times, log_dir, name)
    try:
        server.wait_ready(READY_TIMEOUT_S)
    except BaseException:
        server.kill()
        raise
    return server


def start_timed(args: list[str], times: Path, log_dir: Path, name: str) -> SwarmProcess:
    log_path = log_dir / f"{name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                str(CHILD),
                "timed-stage-server",
                json.dumps({"argv": args, "times": str(times)}),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    return SwarmProcess(args, proc, log_path)


@dataclass
class Procs:
    """The processes of a measurement, closed however it ends."""

    children: list[Child] = field(default_factory=list)
    servers: list[SwarmProcess] = field(default_factory=list)

    def child(self, role: str, args: dict[str, Any], log_dir: Path, name: str) -> Child:
        self.children.append(Child(role, args, log_dir, name))
        return self.children[-1]

    def server(
        self, job_path: Path, stage: int, log_dir: Path, name: str, times: Path | None = None
    ) -> SwarmProcess:
        self.servers.append(stage_server(job_path, stage, log_dir, name, times))
        return self.servers[-1]

    def close(self) -> None:
        for c in self.children:
            c.close()
        for s in self.servers:
            s.stop()


# --- jobs -----------------------------------------------------------------------------------


def state_job_text(d_model: int, n_layers: int) -> str:
    return f"""name = "bulk-state"
[model]
kind = "gpt"
vocab_size = 256
d_model = {d_model}
n_layers = {n_layers}
n_heads = {d_model // 64}
seq_len = 32
[training]
stages = 1
microbatch_size = 1
target_batch_size = 1
steps = 1000
checkpoint_every = 0
[optimizer]
kind = "adamw"
lr = 1e-4
[runtime]
rpc_timeout_s = {STEP_TIMEOUT_S}
commit_timeout_s = {STEP_TIMEOUT_S}
"""


def hop_job_text() -> str:
    d = HOP["d_model"]
    return f"""name = "bulk-hop"
[model]
kind = "gpt"
vocab_size = 1
d_model = {d}
n_layers = 1
n_heads = {d // 64}
seq_len = {HOP["seq_len"]}
[training]
stages = 3
microbatch_size = {HOP["microbatch"]}
target_batch_size = {HOP["microbatch"]}
steps = 1
checkpoint_every = 0
[optimizer]
kind = "adamw"
lr = 1e-4
"""


def stage_parameters(job_path: Path, stage: int) -> int:
    module = stage_layout(load_job(job_path), stage)  # the meta device: no memory
    return sum(p.numel() for p in module.parameters())


def state_job(params: int, work: Path) -> tuple[Path, int]:
    """A one-stage job of about `params` parameters, and its exact count."""
    best: tuple[float, Path, int] | None = None
    for layers in LAYERS:
        d = max(64, round(math.sqrt(params / (12 * layers)) / 64) * 64)
        for width in sorted({max(64, d - 64), d, d + 64}):
            path = work / f"state-d{width}-l{layers}.toml"
            path.write_text(state_job_text(width, layers))
            count = stage_parameters(path, 0)
            error = abs(math.log(count / params))
            if best is None or error < best[0] - 0.01:
                best = (error, path, count)
    assert best is not None
    return best[1], best[2]


# --- measurements ---------------------------------------------------------------------------


@dataclass
class Row:
    path: str
    bytes: int  # per repetition
    seconds: list[float]
    mem: list[tuple[str, int, int, int]]  # (process, peak RSS, state bytes, bytes it holds)
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    per_state: bool = True  # the hop's stages are tiny: its memory is against the boundary

    def first_note(self) -> str:
        """The first repetition's time, where it stands out (a cost a single transfer pays)."""
        first, median = self.seconds[0], statistics.median(self.seconds)
        return f"first of {len(self.seconds)}: {first:.2f} s" if first > 1.5 * median else ""

    @property
    def mbps(self) -> float:
        return self.bytes / statistics.median(self.seconds) / 1e6


def go_and_read(children: list[Child], command: str = "go") -> list[Any]:
    for c in children:
        c.send(command)
    return [c.read("result") for c in children]


def measure_bare(work: Path) -> int:
    procs = Procs()
    try:
        c = procs.child("bare", {}, work, "bare")
        c.read("ready")
        return peak_rss(c.pid)
    finally:
        procs.close()


def measure_stream(params: int, reps: int, state: int, work: Path) -> Row:
    procs = Procs()
    try:
        sink = procs.child("sink", {"params": params}, work, "sink")
        address = sink.read("ready")
        args = {"params": params, "address": address, "chunk_bytes": CHUNK_BYTES}
        source = procs.child("source", {**args, "reps": reps, "warmup": 1}, work, "source")
        source.read("prepared")
        for c in (sink, source):
            reset_peak(c.pid)
        (result,) = go_and_read([source])
        grad = 4 * params
        mem = [(c.name, peak_rss(c.pid), state, grad) for c in (source, sink)]
    finally:
        procs.close()
    return Row("bare stream (the ceiling)", result["bytes"], result["seconds"], mem)


def run_rounds(
    role: str, args: dict[str, Any], n: int, reps: int, name: str, state: int, work: Path
) -> tuple[list[list[Any]], list[tuple[str, int, int, int]]]:
    """`n` children of `role` (seeds 0..n-1) told their group, a warm-up round, then `reps`
    rounds started together: every round's results, and each child's peak RSS after them."""
    procs = Procs()
    try:
        members = [procs.child(role, {**args, "seed": k}, work, f"{name}{k}") for k in range(n)]
        group = [c.read("ready") for c in members]
        for c in members:
            c.send("group " + ",".join(group))
        for c in members:
            c.read("prepared")
            reset_peak(c.pid)
        go_and_read(members, "go warmup")
        rounds = [go_and_read(members, f"go r{r}") for r in range(reps)]
        return rounds, [(c.name, peak_rss(c.pid), state, 4 * args["params"]) for c in members]
    finally:
        procs.close()


def measure_exchange(n: int, params: int, reps: int, state: int, work: Path) -> Row:
    """A round's bytes and pattern over bare streams: the ceiling of any all-reduce over gRPC
    on this machine, where every process sends and receives at once on shared cores."""
    args = {"params": params, "chunk_bytes": CHUNK_BYTES}
    rounds, mem = run_rounds("exchange", args, n, reps, f"exchange{n}-", state, work)
    sent = 2 * (n - 1) * 4 * params // n
    slowest = [max(r["seconds"] for r in results) for results in rounds]
    return Row(f"bare exchange, {n} processes", sent, slowest, mem, "a round's bytes, raw")


def reference_sha(params: int, n: int) -> str:
    """sha256 of ((g0 + g1) + g2) + ... in float32: the butterfly's sum, element by element."""
    import hashlib

    from bench.bulk_child import gradient

    total = gradient(params, 0)
    for k in range(1, n):
        total.add_(gradient(params, k))
    return hashlib.sha256(total.numpy().data.cast("B")).hexdigest()


def measure_pool(n: int, params: int, reps: int, state: int, work: Path) -> Row:
    expected = reference_sha(params, n)  # before the replicas start: not on their cores
    args = {
        "params": params,
        "chunk_bytes": CHUNK_BYTES,
        "max_bytes": 4 * params + CHUNK_BYTES,  # a part and then some
        "timeout_s": POOL_TIMEOUT_S,
        "spill_dir": str(work),  # on the disk the benchmark works on, as a stage server's
    }
    rounds, mem = run_rounds("replica", args, n, reps, f"pool{n}-replica", state, work)
    digests = {result["sha256"] for results in rounds for result in results}
    if digests != {expected}:
        raise RuntimeError(f"pool of {n}: sums {sorted(digests)}, expected {expected}")
    sent = 2 * (n - 1) * 4 * params // n
    slowest = [max(r["seconds"] for r in results) for results in rounds]
    fastest = [min(r["seconds"] for r in results) for results in rounds]
    counted = rounds[0][0]["sent"]  # contributions only: the sums it answers are as many again
    fast = sent / statistics.median(fastest) / 1e6
    return Row(
        f"pool averaging, {n} replicas",
        sent,
        slowest,
        mem,
        f"slowest replica; fastest {fast:.0f} MB/s; sum checked",
        {
            "replica_seconds": [[r["seconds"] for r in rs] for rs in rounds],
            "keep_seconds": [[r["keep_seconds"] for r in rs] for rs in rounds],
            "cpu_seconds": [[r["cpu"] for r in rs] for rs in rounds],
            "counted": counted,
        },
    )


def measure_state(job_path: Path, reps: int, state: int, work: Path, scratch: Path) -> list[Row]:
    """Download, LoadState and the checkpoint, from one trained server."""
    rows: list[Row] = []
    procs = Procs()
    job = {"job": str(job_path), "reps": reps}
    try:
        source = procs.server(job_path, 0, work, "download-server")
        client = procs.child("download", {**job, "address": source.address}, work, "downloader")
        client.read("prepared")
        for pid in (source.proc.pid, client.pid):
            reset_peak(pid)
        (got,) = go_and_read([client])
        mem = [
            ("stage server (sending)", peak_rss(source.proc.pid), state, state),
            ("client (receiving)", peak_rss(client.pid), state, got["bytes"]),
        ]
        rows.append(Row("state download", got["bytes"], got["seconds"], mem))
        rows[-1].note = rows[-1].first_note()
        client.close()

        target = procs.server(job_path, 0, work, "load-server")
        args = {**job, "source": source.address, "address": target.address}
        loader = procs.child("load", args, work, "loader")
        loader.read("prepared")
        for pid in (target.proc.pid, loader.pid):
            reset_peak(pid)
        (got,) = go_and_read([loader])
        mem = [
            ("stage server (receiving)", peak_rss(target.proc.pid), state, state),
            ("client (sending)", peak_rss(loader.pid), state, got["bytes"]),
        ]
        rows.append(Row("LoadState", got["bytes"], got["seconds"], mem))
        rows[-1].note = rows[-1].first_note()
        loader.close()
        target.stop()

        args = {**job, "source": source.address, "dir": str(scratch)}
        writer = procs.child("checkpoint", args, work, "checkpointer")
        writer.read("prepared")
        reset_peak(writer.pid)
        (got,) = go_and_read([writer])
    finally:
        procs.close()
    n = got["bytes"]
    base_w = n / statistics.median(got["baseline_write_seconds"]) / 1e6
    base_r = n / statistics.median(got["baseline_read_seconds"]) / 1e6
    # The process measures its own peaks: writing (it holds the state), then reading (not).
    mem_w = [("checkpoint process, writing", got["write_peak_rss"], state, n)]
    mem_r = [("checkpoint process, reading", got["read_peak_rss"], state, n)]
    write = Row("checkpoint write (save_stage)", n, got["write_seconds"], mem_w)
    read = Row("checkpoint read (load_stage)", n, got["read_seconds"], mem_r)
    write.note = f"{write.mbps / base_w:.2f} of writev+fsync; file {got['file_bytes'] / 1e6:.0f} MB"
    read.note = f"{read.mbps / base_r:.2f} of one read"
    rows += [
        write,
        read,
        Row("  baseline: one writev + fsync", n, got["baseline_write_seconds"], []),
        Row("  baseline: one read", n, got["baseline_read_seconds"], []),
    ]
    return rows


def measure_hop(reps: int, work: Path) -> Row:
    job_path = work / "hop.toml"
    job_path.write_text(hop_job_text())
    states = [16 * stage_parameters(job_path, k) for k in (0, 2)]
    procs = Procs()
    try:
        first = procs.server(job_path, 0, work, "hop-embedding-server")
        last = procs.server(job_path, 2, work, "hop-head-server")
        args = {"job": str(job_path), "first": first.address, "last": last.address}
        client = procs.child("hop", {**args, "reps": reps, "warmup": 1}, work, "hop-client")
        client.read("prepared")
        for pid in (first.proc.pid, last.proc.pid, client.pid):
            reset_peak(pid)
        (got,) = go_and_read([client])
        boundary = got["boundary_bytes"]
        mem = [
            ("embedding stage server", peak_rss(first.proc.pid), states[0], boundary),
            ("head stage server", peak_rss(last.proc.pid), states[1], boundary),
            ("client", peak_rss(client.pid), states[0], boundary),
        ]
    finally:
        procs.close()
    compute = got["first_compute_seconds"] + got["last_compute_seconds"]
    calls = [a + b for a, b in zip(got["first_seconds"], got["last_seconds"], strict=True)]
    nbytes = got["first_bytes"] + got["last_bytes"]
    raw = nbytes / statistics.median(calls) / 1e6
    note = (
        f"{boundary / MiB:.0f} MiB boundary; {compute * 1e3:.0f} ms of compute subtracted "
        f"({raw:.0f} MB/s with it)"
    )
    wire = [max(c - compute, 1e-9) for c in calls]
    extra = {"call_seconds": calls, **got}
    return Row("activation hop", nbytes, wire, mem, note, extra, per_state=False)


def training_job_text(state_job: Path, steps: int = 4) -> str:
    """The state job as a pool trains it: the issue's 4 steps of 8 samples, 128 positions."""
    text = state_job.read_text()
    for old, new in (
        ("seq_len = 32", "seq_len = 128"),
        ("microbatch_size = 1", "microbatch_size = 4"),
        ("target_batch_size = 1", "target_batch_size = 8"),
        ("steps = 1000", f"steps = {steps}"),
    ):
        text = text.replace(old, new)
    data = ROOT / "examples" / "data" / "corpus.txt"
    return text.replace("[training]", f'[data]\nkind = "text"\npath = "{data}"\n[training]')


def measure_training(state_job: Path, state: int, work: Path, steps: int = 4) -> dict[str, Any]:
    """Two stage servers training the stage as one pool (the standalone trainer, in this
    process): each server's peak RSS holds the parameters, AdamW's state, the step's gradient
    sums and whatever a commit and its averaging add."""
    import asyncio

    from client.standalone import train_standalone
    from swarm.ops.progress import StepRecord
    from swarm.rpc.lease import Replica

    path = work / "training.toml"
    path.write_text(training_job_text(state_job, steps))
    job = load_job(path)
    procs = Procs()
    records: list[StepRecord] = []
    times = work / "commit-times.jsonl"
    times.unlink(missing_ok=True)
    try:
        servers = [procs.server(path, 0, work, f"train-{k}", times) for k in range(2)]
        pool = [[Replica(s.address, s.address) for s in servers]]
        asyncio.run(train_standalone(job, pool, on_step=records.append))
        peaks = [peak_rss(s.proc.pid) for s in servers]
    finally:
        procs.close()
    return {
        "replicas": 2,
        "steps": len(records),
        "step_seconds": [r.seconds for r in records],
        "blocked_seconds": [r.blocked_seconds for r in records],
        "peak_rss": peaks,
        "state_bytes": state,
        "rounds": step_rounds(times),
    }


def step_rounds(times: Path) -> list[dict[str, Any]]:
    """Each committed step's averaging round as its members timed it (`timed-stage-server`), in
    order: `round` the slowest member's own (its `all_reduce` call, from its own start);
    `from_last` from when the later member started to when the last one ended (the round's cost,
    without the wait for the member that came later); `apart` how far apart they started;
    `prepare` the slowest member's whole PREPARE (receipts, its sums, the round, the norm);
    `keep` the slowest member's spill writes in the round (seconds, on threads beside it)."""
    events = [json.loads(line) for line in times.read_text().splitlines() if line.strip()]
    rounds: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        if e["what"] == "round":
            rounds.setdefault(e["round"], []).append(e)
    out = []
    for name, members in sorted(rounds.items(), key=lambda kv: min(e["start"] for e in kv[1])):
        starts, ends = [e["start"] for e in members], [e["end"] for e in members]
        prepares = [e for e in events if e["what"] == "prepare" and e["round"] == name]
        keeps = [
            sum(
                k["end"] - k["start"]
                for k in events
                if k["what"] == "keep"
                and k["pid"] == m["pid"]
                and m["start"] <= k["start"] <= m["end"]
            )
            for m in members
        ]
        out.append(
            {
                "round": name,
                "members": len(members),
                "round_seconds": max(e - s for s, e in zip(starts, ends, strict=True)),
                "from_last": max(ends) - max(starts),
                "apart": max(starts) - min(starts),
                "prepare_seconds": max((p["end"] - p["start"] for p in prepares), default=0.0),
                "keep_seconds": max(keeps, default=0.0),
                "cpu_seconds": max(e.get("cpu", 0.0) for e in members),
            }
        )
    return out


# --- the run --------------------------------------------------------------------------------


def run_training(params: int, work: Path, log: Any) -> dict[str, Any]:
    """`--training-only`: the bare process and the pool of 2 training the stage."""
    job_path, count = state_job(params, work)
    job = load_job(job_path)
    log(f"stage: {job.model.d_model} x {job.model.n_layers} blocks, {count / 1e6:.1f}M params")
    bare = measure_bare(work)
    training = measure_training(job_path, 16 * count, work)
    log(f"training a pool of 2: peaks {[round(p / GiB, 2) for p in training['peak_rss']]} GiB")
    return {"params": count, "bare_process_bytes": bare, "training": training}


def round_pair(pool: Row, training: dict[str, Any]) -> dict[str, Any]:
    """An isolated pool of 2's rounds and a training pool of 2's, measured one after the other:
    their medians (a step's after its first round, which dials the channels as the isolated
    pool's warm-up does) and the ratio the issue's target reads, isolated s / a step's s."""
    later = training["rounds"][1:] or training["rounds"]
    isolated = statistics.median(pool.seconds)
    own = statistics.median(r["round_seconds"] for r in later)
    last = statistics.median(r["from_last"] for r in later)
    keep = pool.extra.get("keep_seconds", [])
    return {
        "isolated_seconds": pool.seconds,
        "isolated_keep_seconds": [max(k) for k in keep],
        "isolated_cpu_seconds": [max(c) for c in pool.extra.get("cpu_seconds", [])],
        "isolated": isolated,
        "step_round": own,
        "step_round_from_last": last,
        "ratio": isolated / own,
        "ratio_from_last": isolated / last,
        "rounds": training["rounds"],
        "blocked_seconds": training["blocked_seconds"],
        "load": training.get("load"),
    }


def run_rounds_only(
    params: int, reps: int, pairs: int, steps: int, work: Path, log: Any
) -> dict[str, Any]:
    """`--rounds-only`: `pairs` times, the isolated pool of 2 (`reps` rounds) then the pool of 2
    training the stage (its rounds timed in its servers): a step's round against the isolated
    one, pair by pair (on a shared machine the load moves between runs: compare within a
    pair)."""
    job_path, count = state_job(params, work)
    job = load_job(job_path)
    state = 16 * count
    log(f"stage: {job.model.d_model} x {job.model.n_layers} blocks, {count / 1e6:.1f}M params")
    out: list[dict[str, Any]] = []
    for k in range(pairs):
        load = os.getloadavg()
        pool = measure_pool(2, count, reps, state, work)
        training = measure_training(job_path, state, work, steps)
        out.append({**round_pair(pool, training), "load": load})
        got = out[-1]
        log(f"pair {k}: isolated {got['isolated']:.3f} s, a step's {got['step_round']:.3f} s")
    return {"params": count, "round_pairs": out}


def run(params: int, reps: int, scratch: Path, work: Path, log: Any) -> dict[str, Any]:
    job_path, count = state_job(params, work)
    job = load_job(job_path)
    state = 16 * count
    log(f"stage: {job.model.d_model} x {job.model.n_layers} blocks, {count / 1e6:.1f}M params")
    bare = measure_bare(work)
    log(f"bare process: {bare / GiB:.2f} GiB")
    rows = [measure_stream(count, reps, state, work)]
    log(f"{rows[-1].path}: {rows[-1].mbps:.0f} MB/s")
    for n in (2, 4):
        rows.append(measure_exchange(n, count, reps, state, work))
        log(f"{rows[-1].path}: {rows[-1].mbps:.0f} MB/s")
        rows.append(measure_pool(n, count, reps, state, work))
        rows[-1].note += f"; {rows[-1].mbps / rows[-2].mbps:.2f} of the bare exchange"
        log(f"{rows[-1].path}: {rows[-1].mbps:.0f} MB/s")
    first = len(rows)
    rows += measure_state(job_path, reps, state, work, scratch)
    log("state paths: " + ", ".join(f"{r.path} {r.mbps:.0f} MB/s" for r in rows[first:]))
    rows.append(measure_hop(reps, work))
    log(f"{rows[-1].path}: {rows[-1].mbps:.0f} MB/s")
    load = os.getloadavg()
    pool = measure_pool(2, count, reps, state, work)  # again: the pair's isolated rounds
    training = measure_training(job_path, state, work)
    log(f"training a pool of 2: peaks {[round(p / GiB, 2) for p in training['peak_rss']]} GiB")
    ceiling = rows[0].mbps
    return {
        "training": training,
        "round_pairs": [{**round_pair(pool, training), "load": load}],
        "params": count,
        "d_model": job.model.d_model,
        "n_layers": job.model.n_layers,
        "state_bytes": state,
        "bare_process_bytes": bare,
        "chunk_bytes": CHUNK_BYTES,
        "reps": reps,
        "rows": [
            {
                "path": r.path.strip(),
                "mb_per_s": r.mbps,
                "vs_bare_stream": r.mbps / ceiling,
                "bytes": r.bytes,
                "seconds": r.seconds,
                "note": r.note,
                "per_state": r.per_state,
                "processes": [
                    {"process": name, "peak_rss": peak, "state_bytes": st, "holds_bytes": holds}
                    for name, peak, st, holds in r.mem
                ],
                **r.extra,
            }
            for r in rows
        ],
    }


def print_tables(out: dict[str, Any]) -> None:
    state, bare = out["state_bytes"], out["bare_process_bytes"]
    print(
        f"stage: byte GPT d_model {out['d_model']}, {out['n_layers']} blocks, "
        f"{out['params'] / 1e6:.1f}M params; state {state / 1e9:.2f} GB (16 B a parameter); "
        f"bare process {bare / GiB:.2f} GiB; chunks {out['chunk_bytes'] // MiB} MiB; "
        f"median of {out['reps']}"
    )
    print()
    print("| path | MB/s | vs bare stream | peak RSS GiB | peak/state | notes |")
    print("|---|---:|---:|---:|---:|---|")
    for r in out["rows"]:
        procs = r["processes"]
        top = max(procs, key=lambda p: p["peak_rss"]) if procs else None
        peak = f"{top['peak_rss'] / GiB:.2f}" if top else ""
        ratio = f"{top['peak_rss'] / top['state_bytes']:.2f}" if top and r["per_state"] else ""
        print(
            f"| {r['path']} | {r['mb_per_s']:.0f} | {r['vs_bare_stream']:.2f} | {peak} | "
            f"{ratio} | {r['note']} |"
        )
    print()
    print("state: 16 B x the parameters of the stage the process works for; bare: as above")
    print()
    print(
        "| path | process | peak RSS GiB | peak/state | (peak-bare)/state | holds GB | "
        "(peak-bare)/holds |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in out["rows"]:
        for p in r["processes"]:
            peak, st, holds = p["peak_rss"], p["state_bytes"], p["holds_bytes"]
            of_state = "n/a | n/a"
            if r["per_state"]:
                of_state = f"{peak / st:.2f} | {(peak - bare) / st:.2f}"
            print(
                f"| {r['path']} | {p['process']} | {peak / GiB:.2f} | {of_state} | "
                f"{holds / 1e9:.3f} | {(peak - bare) / holds:.2f} |"
            )


def print_training(out: dict[str, Any]) -> None:
    t, bare = out["training"], out["bare_process_bytes"]
    state = t["state_bytes"]
    print()
    print(
        f"training the stage as a pool of {t['replicas']} ({t['steps']} steps of 8 samples, "
        "standalone trainer): each replica's peak RSS against its state (the target: "
        "(peak - bare) / state <= 1.25)"
    )
    print()
    print("| replica | peak RSS GiB | peak/state | (peak-bare)/state |")
    print("|---|---:|---:|---:|")
    for k, peak in enumerate(t["peak_rss"]):
        print(f"| {k} | {peak / GiB:.2f} | {peak / state:.2f} | {(peak - bare) / state:.2f} |")
    steps = ", ".join(f"{s:.1f}" for s in t["step_seconds"])
    blocked = ", ".join(f"{s:.1f}" for s in t["blocked_seconds"])
    print(f"\nstep seconds: {steps}; blocked on the commit: {blocked}")


def print_rounds(pairs: list[dict[str, Any]]) -> None:
    """A training pool's rounds against the isolated pool of 2, pair by pair (the issue's
    target: a step's round >= 0.8 of the isolated one, as speed: isolated s / a step's s)."""
    if not pairs:
        return
    print()
    print(
        "a step's averaging round (1 stage, 2 replicas, 4 steps; timed in its stage servers) "
        "against the isolated pool of 2 run just before it; a step's: its rounds after the first"
    )
    for k, p in enumerate(pairs):
        load = "/".join(f"{x:.1f}" for x in p["load"]) if p.get("load") else "?"
        keep, cpu = p["isolated_keep_seconds"], p.get("isolated_cpu_seconds", [])
        spill = f"{statistics.median(keep):.3f}" if keep else "?"
        used = f"{statistics.median(cpu):.3f}" if cpu else "?"
        print(
            f"\npair {k} (load {load} before it): isolated rounds "
            f"{', '.join(f'{x:.3f}' for x in p['isolated_seconds'])} s (their spill {spill} s, "
            f"CPU {used} s: medians, the slower replica's)"
        )
        print()
        print("| step | round s | from the last start s | apart s | PREPARE s | spill s | CPU s |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for j, r in enumerate(p["rounds"]):
            print(
                f"| {j} | {r['round_seconds']:.3f} | {r['from_last']:.3f} | {r['apart']:.3f} | "
                f"{r['prepare_seconds']:.3f} | {r['keep_seconds']:.3f} | "
                f"{r.get('cpu_seconds', 0.0):.3f} |"
            )
    print()
    print("| pair | isolated s | a step's s | ratio | from the last start s | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for k, p in enumerate(pairs):
        print(
            f"| {k} | {p['isolated']:.3f} | {p['step_round']:.3f} | {p['ratio']:.2f} | "
            f"{p['step_round_from_last']:.3f} | {p['ratio_from_last']:.2f} |"
        )
    ratios = [p["ratio"] for p in pairs]
    lasts = [p["ratio_from_last"] for p in pairs]
    print(
        f"\na step's round against the isolated: median ratio {statistics.median(ratios):.2f} "
        f"over {len(pairs)} pairs (from the last member's start: {statistics.median(lasts):.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=50e6, help="the stage's parameters")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions of each path")
    parser.add_argument(
        "--dir", type=Path, default=Path(tempfile.gettempdir()), help="where checkpoints go"
    )
    parser.add_argument(
        "--training-only",
        action="store_true",
        help="only a pool of 2 training the stage, and its replicas' peak RSS (a large --params "
        "without the transfer rows)",
    )
    parser.add_argument(
        "--rounds-only",
        action="store_true",
        help="only the bare exchange and the pool of 2, isolated, then the pool of 2 training the "
        "stage: a step's averaging round against the isolated one",
    )
    parser.add_argument(
        "--pairs", type=int, default=3, help="--rounds-only: isolated and training pairs to run"
    )
    parser.add_argument(
        "--steps", type=int, default=4, help="--rounds-only: steps of each training pool"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    torch.set_num_threads(1)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    work = Path(tempfile.mkdtemp(prefix="swarm-bulk-"))
    try:
        if args.training_only:
            out = run_training(int(args.params), work, log)
        elif args.rounds_only:
            out = run_rounds_only(int(args.params), args.reps, args.pairs, args.steps, work, log)
        else:
            out = run(int(args.params), args.reps, args.dir, work, log)
    except BaseException:
        log(f"logs kept in {work}")
        raise
    shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        if not args.training_only and not args.rounds_only:
            print_tables(out)
        if not args.rounds_only:
            print_training(out)
        print_rounds(out.get("round_pairs", []))


if __name__ == "__main__":
    main()
