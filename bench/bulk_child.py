"""The processes of `bench/bulk.py`, one role each: `python bench/bulk_child.py ROLE JSON_ARGS`.

Not run by hand. A child talks to the benchmark in lines: it writes one JSON object a line on
stdout (`{"ready": ...}`, `{"prepared": ...}`, `{"result": ...}`) and reads commands on stdin
(`go <round>`, `group <a,b,...>`, `quit`). Between a child's "prepared" line and the "go" the
benchmark resets the child's peak RSS (`/proc/<pid>/clear_refs`), so a peak is the measured path's
and not its set-up's; it reads the peak from `/proc/<pid>/status` once the child has answered.
Every role runs torch on one thread, as a stage server (`--threads 1`) does.

Roles:
- `bare`: imports torch and grpc, builds AdamW over a 1-element tensor and steps it once: the
  peak RSS of a process with nothing in it.
- `sink` / `source`: the bare `grpc.aio` stream: `source` writes a float32 gradient's bytes in
  `chunk` pieces on one stream-stream call (identity serialisation: raw bytes), `sink` adds each
  piece into a preallocated float32 tensor and answers when all came.
- `exchange`: a round's bytes and pattern over bare `grpc.aio` streams (see `exchange`).
- `replica`: a pool replica as `tests/support/pools.py` builds one (`PoolServicer` and `Averager`
  on a `grpc.aio` server, a `ChannelPool`), holding a seeded random flat gradient; each `go`
  runs `butterfly.all_reduce` over the group last given, in place as a commit averages (each
  slice kept in a `Spill` in the work directory first; the gradient restored from it after the
  round, untimed), and answers its seconds, the sha256 of the sum, its seconds in the spill's
  writes and the CPU seconds the process used in the round (every thread's).
- `download`: trains one step on a stage server (so it holds AdamW's moments), then downloads
  its state with `StageClient.download_state(include_optimizer=True)`, `reps` times.
- `load`: downloads a state from one stage server (not timed), then `StageClient.load_state`s
  it into another, `reps` times.
- `checkpoint`: downloads a state (not timed), then writes it with `checkpoint.save_stage` and
  reads it with `load_stage`, against one `write` + `fsync` of as many bytes and one `read`.
- `hop`: `StageClient.forward` of a large boundary through two stage servers (see bulk.py), and
  the same stages' compute timed in this process, to be subtracted.
- `timed-stage-server`: `swarm stage-server` itself in this process (JSON args: its `argv`), each
  commit's PREPARE, APPLY, averaging round and spill writes timed into the file `times` (see
  `timed_stage_server`): a training step's round, measured where it runs. Its output is the
  server's (the ready line the benchmark waits for), not JSON lines.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import os
import statistics
import struct
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import torch  # noqa: E402

from swarm.wire.crossing import Crossing  # noqa: E402

MiB = 1 << 20
STREAM_METHOD = "/bench.Bulk/Stream"
POOL_JOB = "bench-bulk"
# torch.frombuffer on a received (read-only) bytes object: nothing here writes to it.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


async def command() -> list[str]:
    """The next line on stdin, split (read on a thread: the event loop keeps serving)."""
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    return line.split() or ["quit"]  # EOF: the benchmark is gone


async def wait_for(word: str) -> list[str]:
    while (cmd := await command())[0] != word:
        if cmd[0] == "quit":
            raise SystemExit(0)
    return cmd


def options(max_message: int = 64 * MiB) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message),
        ("grpc.max_receive_message_length", max_message),
    ]


def gradient(params: int, seed: int) -> torch.Tensor:
    return torch.randn(params, generator=torch.Generator().manual_seed(seed))


# --- bare process ---------------------------------------------------------------------------


async def bare(args: dict[str, Any]) -> None:
    one = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([one])
    one.grad = torch.ones(1)
    optimizer.step()
    say(ready=grpc.__version__)
    await wait_for("quit")


# --- bare stream ----------------------------------------------------------------------------


async def serve_stream(stream: Any) -> tuple[grpc.aio.Server, str]:
    """A started server whose one method, `STREAM_METHOD`, is `stream` over raw bytes; and its
    address."""
    handler = grpc.method_handlers_generic_handler(
        "bench.Bulk", {"Stream": grpc.stream_stream_rpc_method_handler(stream)}
    )
    server = grpc.aio.server(options=options())
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def sink(args: dict[str, Any]) -> None:
    acc = torch.zeros(args["params"])

    async def stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        off = 0
        async for chunk in requests:
            values = torch.frombuffer(chunk, dtype=torch.float32)
            acc[off : off + values.numel()].add_(values)
            off += values.numel()
        yield struct.pack("<q", off)

    server, address = await serve_stream(stream)
    say(ready=address)
    await wait_for("quit")
    await server.stop(None)


async def source(args: dict[str, Any]) -> None:
    grad = gradient(args["params"], 0)
    raw = grad.numpy().data.cast("B")
    chunk = args["chunk_bytes"]
    async with grpc.aio.insecure_channel(args["address"], options=options()) as channel:
        method = channel.stream_stream(STREAM_METHOD)
        say(prepared=True)
        await wait_for("go")
        seconds = []
        for rep in range(args["warmup"] + args["reps"]):
            started = time.perf_counter()
            call: Any = method()
            for off in range(0, len(raw), chunk):
                await call.write(bytes(raw[off : off + chunk]))
            await call.done_writing()
            (reply,) = [r async for r in call]
            elapsed = time.perf_counter() - started
            if struct.unpack("<q", reply)[0] != grad.numel():
                raise RuntimeError(f"the sink summed {reply!r} values of {grad.numel()}")
            if rep >= args["warmup"]:
                seconds.append(elapsed)
    say(result={"seconds": seconds, "bytes": len(raw)})
    await wait_for("quit")


# --- bare exchange --------------------------------------------------------------------------


async def exchange(args: dict[str, Any]) -> None:
    """The bytes and pattern of a round, bare: to every other member at once, a call that
    streams the member's part of this gradient (raw bytes); the member adds it into a float32
    tensor and answers with as many bytes of its own part, as an owner answers its part's sum."""
    grad = gradient(args["params"], args["seed"])
    chunk = args["chunk_bytes"]
    acc = torch.zeros(grad.numel())

    async def stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        off = int(dict(context.invocation_metadata())["offset"])
        start = off
        async for piece in requests:
            values = torch.frombuffer(piece, dtype=torch.float32)
            acc[off : off + values.numel()].add_(values)
            off += values.numel()
        answer = acc[start:off].numpy().data.cast("B")
        for at in range(0, len(answer), chunk):
            yield bytes(answer[at : at + chunk])

    server, address = await serve_stream(stream)
    say(ready=address)
    group = (await wait_for("group"))[1].split(",")
    me = group.index(address)
    n = len(group)
    bounds = [k * grad.numel() // n for k in range(n + 1)]
    raw = grad.numpy().data.cast("B")
    channels = [grpc.aio.insecure_channel(a, options=options()) for a in group]
    methods = [c.stream_stream(STREAM_METHOD) for c in channels]
    say(prepared=True)

    async def one(k: int) -> int:
        call: Any = methods[k](metadata=(("offset", str(bounds[k])),))
        for at in range(4 * bounds[k], 4 * bounds[k + 1], chunk):
            await call.write(bytes(raw[at : min(at + chunk, 4 * bounds[k + 1])]))
        await call.done_writing()
        return sum([len(r) async for r in call])

    try:
        while (await command())[0] == "go":
            started = time.perf_counter()
            got = await asyncio.gather(*(one(k) for k in range(n) if k != me))
            seconds = time.perf_counter() - started
            say(result={"seconds": seconds, "received": sum(got)})
    finally:
        for c in channels:
            await c.close()
        await server.stop(None)


# --- pool replica ---------------------------------------------------------------------------


async def replica(args: dict[str, Any]) -> None:
    from stage_server.averaging.butterfly import RoundSettings, all_reduce
    from stage_server.averaging.channels import ChannelPool
    from stage_server.averaging.owner import Averager
    from stage_server.averaging.service import PoolServicer
    from stage_server.averaging.spill import Spill
    from swarm.errors import NotFound
    from swarm.proto import pool_pb2_grpc

    def route(job: str, stage: int) -> None:
        if job != POOL_JOB or stage != 0:
            raise NotFound(f"job {job!r} stage {stage} is not served here")

    flat = gradient(args["params"], args["seed"])
    chunk, most, timeout = args["chunk_bytes"], args["max_bytes"], args["timeout_s"]
    server = grpc.aio.server(options=options())
    averager = Averager()
    servicer = PoolServicer(
        averager, route=route, chunk_bytes=chunk, max_bytes=most, timeout_s=timeout
    )
    pool_pb2_grpc.add_PoolServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channels = ChannelPool(options=options())
    say(ready=f"127.0.0.1:{port}")
    group = (await wait_for("group"))[1].split(",")
    index = group.index(f"127.0.0.1:{port}")
    say(prepared=True)
    counted = [0, 0]  # this round's (sent, received), as all_reduce counts them

    def on_bytes(sent: int, received: int) -> None:
        counted[0] += sent
        counted[1] += received

    # As a commit averages a step's sums: in place, each slice kept in an unlinked file in the
    # spill directory before its sum lands over it; the gradient is restored from the spill
    # after each round (not timed) for the next.
    spill = Spill(flat, Path(args["spill_dir"]))

    kept = [0.0]  # this round's seconds in the spill's writes (on threads beside the round)

    def timed_keep(where: slice) -> None:
        start = time.perf_counter()
        spill.keep(where)
        kept[0] += time.perf_counter() - start

    async def keep(where: slice) -> None:
        await asyncio.to_thread(timed_keep, where)

    try:
        while (cmd := await command())[0] == "go":
            counted[:], kept[0] = [0, 0], 0.0
            cpu = time.process_time()
            started = time.perf_counter()
            settings = RoundSettings(
                group=group,
                index=index,
                round=cmd[1],
                job=POOL_JOB,
                stage=0,
                timeout_s=timeout,
                chunk_bytes=chunk,
                max_bytes=most,
                in_place=True,
            )
            total = await all_reduce(
                flat, settings, averager=averager, channels=channels, on_bytes=on_bytes, keep=keep
            )
            seconds = time.perf_counter() - started
            cpu = time.process_time() - cpu
            digest = hashlib.sha256(total.numpy().data.cast("B")).hexdigest()
            del total
            spill.restore()
            say(
                result={
                    "seconds": seconds,
                    "sha256": digest,
                    "sent": counted[0],
                    "keep_seconds": kept[0],
                    "cpu": cpu,
                }
            )
    finally:
        await channels.close()
        await server.stop(None)


# --- state transfer -------------------------------------------------------------------------


def stage_client(args: dict[str, Any], address: str) -> Any:
    from swarm.job.config import load_job
    from swarm.job.fingerprint import fingerprint
    from swarm.rpc.stage_client import StageClient

    job = load_job(Path(args["job"]))
    return StageClient(address, job, fingerprint(job), args.get("stage", 0))


def expected(client: Any) -> Any:
    from swarm.model.state_checks import StateChecks

    return StateChecks(client.job, client.stage)


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


async def train_one_step(client: Any) -> None:
    """One step of one microbatch on a single replica: it then holds AdamW's moments."""
    job = client.job
    shape = (job.training.microbatch_size, job.model.seq_len)
    tokens = torch.randint(0, job.model.vocab_size, shape, generator=torch.Generator())
    await client.forward_backward(0, 0, Crossing(tokens), tokens, need_grad_inputs=False)
    await client.commit(0, [0], job.training.microbatch_size)


async def download(args: dict[str, Any]) -> None:
    client = stage_client(args, args["address"])
    await train_one_step(client)
    say(prepared=True)
    await wait_for("go")
    seconds, nbytes, tensors = [], 0, 0
    expect = expected(client)  # built once, as a replica does (its first use imports dynamo)
    for _ in range(args["reps"]):
        started = time.perf_counter()
        step, state = await client.download_state(True, prefix="", expect=expect)
        seconds.append(time.perf_counter() - started)
        nbytes, tensors = state_bytes(state), len(state)
        del state
    await client.close()
    say(result={"seconds": seconds, "bytes": nbytes, "tensors": tensors, "step": step})
    await wait_for("quit")


async def load(args: dict[str, Any]) -> None:
    source = stage_client(args, args["source"])
    step, state = await source.download_state(True, prefix="", expect=expected(source))
    await source.close()
    client = stage_client(args, args["address"])
    say(prepared=True)
    await wait_for("go")
    seconds = []
    for _ in range(args["reps"]):
        started = time.perf_counter()
        loaded = await client.load_state(step, state)
        seconds.append(time.perf_counter() - started)
        if loaded != step:
            raise RuntimeError(f"LoadState of step {step} answered step {loaded}")
    await client.close()
    say(result={"seconds": seconds, "bytes": state_bytes(state), "tensors": len(state)})
    await wait_for("quit")


def _uncache(path: Path) -> None:
    """Drop `path`'s pages from the page cache (written and fsynced: they are clean), so that
    the read that follows comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _settle(seconds: float = 2.0) -> None:
    """Let the disk finish what earlier writes left it (ours and the host's) before a timed
    write."""
    os.sync()
    time.sleep(seconds)


def _write_tensors(path: Path, tensors: list[torch.Tensor]) -> None:
    """The tensors' bytes from their own memory, in order, with one `writev` (a few where the
    kernel takes less a call) and `fsync`: the bytes a checkpoint writes, with nothing else."""
    views = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors if t.numel()]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while views:
            done = os.writev(fd, views[: os.sysconf("SC_IOV_MAX")])
            while views and done >= len(views[0]):
                done -= len(views[0])
                views.pop(0)
            if views and done:
                views[0] = views[0][done:]
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_all(path: Path, into: memoryview) -> int:
    """One `read` into `into` (again a few past 2 GiB); the bytes read."""
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(into) and (n := f.readinto(into[done:])):
            done += n
    return done


def own_peak() -> int:
    """This process's VmHWM in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_own_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


async def checkpoint(args: dict[str, Any]) -> None:
    from swarm.model import checkpoint as ckpt

    source = stage_client(args, args["source"])
    step, state = await source.download_state(True, prefix="", expect=expected(source))
    await source.close()
    nbytes, names = state_bytes(state), sorted(state)
    root = Path(tempfile.mkdtemp(prefix="swarm-bulk-", dir=args["dir"]))
    try:
        # The read's baseline: the state's bytes read with one read into a buffer allocated and
        # touched beforehand (allocating is not the disk's).
        into = torch.zeros(nbytes, dtype=torch.uint8)
        baseline = root / "baseline.bin"
        write_base, read_base = [], []
        for _ in range(args["reps"]):
            _write_tensors(baseline, list(state.values()))
            _uncache(baseline)
            started = time.perf_counter()
            got = _read_all(baseline, into.numpy().data)
            read_base.append(time.perf_counter() - started)
            if got != nbytes:
                raise RuntimeError(f"read {got} bytes of {nbytes}")
            baseline.unlink()
        del into
        say(prepared=True)  # the peak from here on is the checkpoint's
        await wait_for("go")
        write_s, read_s, paths = [], [], []
        for rep in range(args["reps"]):
            # The write's baseline and the checkpoint in turn, each after the disk settled, so
            # that both meet it in the same state (on a VM a write right after another runs
            # up to 5 x slower while the host still flushes the first; fsync does not wait
            # for that): the same bytes from the tensors' memory with one writev and fsync.
            _settle()
            started = time.perf_counter()
            _write_tensors(baseline, list(state.values()))
            write_base.append(time.perf_counter() - started)
            baseline.unlink()
            _settle()
            started = time.perf_counter()
            ckpt.save_stage(root, step + rep, 0, state)
            write_s.append(time.perf_counter() - started)
            paths.append(root / f"step-{step + rep:08d}" / "stage-0.safetensors")  # its layout
        write_peak = own_peak()
        del state  # reading: the peak of a process that holds only what it reads
        gc.collect()
        reset_own_peak()
        for rep, path in enumerate(paths):
            _uncache(path)
            started = time.perf_counter()
            back = ckpt.load_stage(root, step + rep, 0)
            read_s.append(time.perf_counter() - started)
            if sorted(back) != names or state_bytes(back) != nbytes:
                raise RuntimeError("load_stage gave other tensors than save_stage wrote")
            del back
        read_peak = own_peak()
        file_bytes = paths[0].stat().st_size
    finally:
        for path in sorted(root.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        root.rmdir()
    say(
        result={
            "write_seconds": write_s,
            "read_seconds": read_s,
            "baseline_write_seconds": write_base,
            "baseline_read_seconds": read_base,
            "bytes": nbytes,
            "file_bytes": file_bytes,
            "write_peak_rss": write_peak,
            "read_peak_rss": read_peak,
        }
    )
    await wait_for("quit")


# --- activation hop -------------------------------------------------------------------------


def _compute_seconds(job: Any, stage: int, x: torch.Tensor, reps: int) -> float:
    """The median seconds of stage `stage`'s forward on `x` here, on one thread, as the server
    computes a Forward with `evaluate` (no graph)."""
    from swarm.model.transformer import build_stage

    module = build_stage(job, stage, "cpu")
    times = []
    with torch.no_grad():
        for _ in range(reps + 1):
            started = time.perf_counter()
            module(x)
            times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


async def hop(args: dict[str, Any]) -> None:
    from swarm.rpc.stage_client import as_tensor

    first = stage_client({**args, "stage": 0}, args["first"])
    last = stage_client({**args, "stage": 2}, args["last"])
    job = first.job
    tokens = torch.zeros(job.training.microbatch_size, job.model.seq_len, dtype=torch.long)
    say(prepared=True)
    await wait_for("go")
    out_s, in_s, out_bytes, in_bytes, back_bytes = [], [], 0, 0, 0
    hidden = torch.empty(0)
    for rep in range(args["warmup"] + args["reps"]):
        started = time.perf_counter()
        hidden = as_tensor(await first.forward(0, rep, Crossing(tokens), evaluate=True))
        middle = time.perf_counter()
        logits = as_tensor(await last.forward(0, rep, Crossing(hidden), evaluate=True))
        ended = time.perf_counter()
        if rep >= args["warmup"]:
            out_s.append(middle - started)
            in_s.append(ended - middle)
        out_bytes, in_bytes = hidden.nbytes + tokens.nbytes, hidden.nbytes + logits.nbytes
        back_bytes = logits.nbytes
    await first.close()
    await last.close()
    compute_first = _compute_seconds(job, 0, tokens, args["reps"])
    compute_last = _compute_seconds(job, 2, hidden.clone(), args["reps"])
    say(
        result={
            "first_seconds": out_s,
            "last_seconds": in_s,
            "first_bytes": out_bytes,  # tokens in, the boundary out
            "last_bytes": in_bytes,  # the boundary in, the logits out
            "boundary_bytes": hidden.nbytes,
            "logits_bytes": back_bytes,
            "first_compute_seconds": compute_first,
            "last_compute_seconds": compute_last,
        }
    )
    await wait_for("quit")


# --- a timed stage server -------------------------------------------------------------------


def timed_stage_server(args: dict[str, Any]) -> None:
    """`swarm stage-server ARGV` in this process, each of its commits' phases timed: a JSON line
    a phase (`{"what", "round", "step", "start", "end"}`, CLOCK_MONOTONIC seconds, one clock for
    every process of the machine) appended to the file `args["times"]`. Timed: a PREPARE whole
    (`prepare`), its all-reduce (`round`: from this member's call of `all_reduce` to its
    return), the spill's writes (`keep`, each), and an APPLY (`apply`). Nothing else changes:
    the functions are wrapped where `stage_server.replica.commit` calls them."""
    import functools

    from stage_server.averaging import spill as spill_module
    from stage_server.replica import commit as commit_module
    from swarm.cli import main as swarm_main

    fd = os.open(args["times"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def record(what: str, start: float, **fields: Any) -> None:
        line = {"what": what, "start": start, "end": time.monotonic(), "pid": os.getpid()}
        os.write(fd, (json.dumps({**line, **fields}) + "\n").encode())

    reduce = commit_module.all_reduce

    @functools.wraps(reduce)
    async def timed_reduce(flat: torch.Tensor, settings: Any, **kwargs: Any) -> torch.Tensor:
        start, cpu = time.monotonic(), time.process_time()
        total = await reduce(flat, settings, **kwargs)
        cpu = time.process_time() - cpu  # every thread's of this process, the round's and not
        record("round", start, round=settings.round, index=settings.index, cpu=cpu)
        return total

    commit = commit_module.Committer.commit

    @functools.wraps(commit)
    async def timed_commit(self: Any, c: Any) -> Any:
        start = time.monotonic()
        done = await commit(self, c)
        what = "prepare" if c.prepare and not c.apply else "apply" if c.apply else "commit"
        record(what, start, round=c.round, step=c.step, index=c.group_index)
        return done

    keep = spill_module.Spill.keep

    @functools.wraps(keep)
    def timed_keep(self: Any, where: slice) -> None:
        start = time.monotonic()
        keep(self, where)
        record("keep", start, bytes=(where.stop - where.start) * self.flat.element_size())

    commit_module.all_reduce = timed_reduce  # type: ignore[assignment]
    commit_module.Committer.commit = timed_commit  # type: ignore[method-assign]
    spill_module.Spill.keep = timed_keep  # type: ignore[method-assign]
    raise SystemExit(swarm_main(args["argv"]))


ROLES = {
    "bare": bare,
    "sink": sink,
    "source": source,
    "exchange": exchange,
    "replica": replica,
    "download": download,
    "load": load,
    "checkpoint": checkpoint,
    "hop": hop,
}


def main() -> None:
    role, args = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    torch.set_num_threads(1)
    if role == "timed-stage-server":  # its own event loop, as `swarm stage-server` runs one
        return timed_stage_server(args)
    asyncio.run(ROLES[role](args))


if __name__ == "__main__":
    main()
