"""WAN: samples/s of a swarm (4 stage servers, one standalone trainer) whose hosts are spread over
Linux network namespaces, each host's link shaped to a rate and a one-way delay, against the same
swarm unshaped, measured in the same run.

    sudo .venv/bin/python bench/wan.py [--rate 100mbit|20mbit|none] [--delay-ms 0]
        [--codec none|fp16|bf16|int8_blockwise] [--averaging none|fp16|bf16|int8_blockwise]
        [--data-plane push|relay] [--steps 10]
        [--max-in-flight 8] [--workload d256|tiny | --small] [--replicas 1]
        [--delayed-update] [--standby 0] [--checkpoint-every 0]
        [--control none|torch [--torch-schedule gpipe,1f1b]] [--json]

Pools. `--replicas R` serves each stage with R replicas, each a host of its own (`s<k>r<j>`), so
every step ends with each pool averaging its gradients over the shaped links; the seconds per
step no microbatch could be leased because a commit was under way (the coordinator's
`blocked_seconds`) are printed for both runs. `--delayed-update` runs the job with
`training.delayed_update`, which overlaps each step's averaging with the next step.
`--standby N` (with `--replicas` above N) makes N of each stage's servers standbys
(`runtime.standby`, issue 67): they follow the stage's updates and serve nothing, so their hosts'
received bytes are a standby's cost a microbatch, and the samples/s against a run of
`--replicas` less N without one is its cost in speed (`bench/standby_cost.py` runs both and
judges it). `--averaging` is the pools' codec (`compression.averaging`): a standby of a pool that
averages in a lossy one receives each step's sum in it (a pool of one averages nothing, and its
standby receives the float32 sum).

Checkpoints. `--checkpoint-every N` has the trainer save a checkpoint every N steps
(`training.checkpoint_every`, `--checkpoint-dir`): each stage's parameters and optimizer state are
downloaded from its server mid-job, over that host's uplink, beside the boundary's sends (which a
download waits for: `stage_server.peer.uplink`), and into the trainer's downlink.

Hosts. The trainer and each stage server run in a namespace of their own (`swb-<pid>-<host>`),
with one address on 10.77.0.0/24 on their `eth0`: one end of a veth pair whose other end is a
port of one bridge in a namespace of the benchmark's (`swb-<pid>-net`). Nothing is added to the
root namespace; leftovers of an earlier run that died (namespaces `swb-*` whose benchmark is gone,
with any process still in them) are removed first, and everything is removed on exit, on Ctrl-C
and SIGTERM as well.

Shaping. `tc qdisc tbf` at `--rate` on the egress of both ends of each host's veth pair: the
host's end limits what the host sends, the bridge's end what it receives. netem is not built into
every kernel (not into this one), so the one-way delay is a relay: in each stage server's
namespace the server listens on the namespace's loopback and a small asyncio TCP relay (this file,
run as its own process) listens on the host's address, forwards to the server, and holds every
chunk it reads for `--delay-ms` before writing it on, in order, in both directions. A message
to a stage server, from the trainer or (push) from the stage before it, thus arrives `--delay-ms`
late, and its answer too (the trainer has no relay of its own: it only calls).
The relay reads eagerly, so TCP's window does not see the delay; HTTP/2's flow control windows,
end to end over it, do.

Runs. The unshaped run (no tbf, no relay; a plain `pfifo` counts the bytes) and then the shaped
one, each on freshly started stage servers (`--threads 1` each; the trainer too) and the same job
of `--steps` + 2 steps. The first step is warm-up; samples/s is the wall time from the end of the
warm-up step to the end of the last timed one, as seen (polled) in the trainer's `--log`. The step
after them is not counted: it keeps the pipeline as busy while the last counters are read as it
was while the first were, so the two reads' lag behind a step's end cancels, and the trainer is
killed during it (its end-of-job download of the model never crosses the links).

Bytes. Each host's bytes sent and received over the same window, read from the qdisc counters at
both ends of its link (what tbf charges: every TCP segment with its headers, about 4% more than
the payload), per microbatch of the window. The bound of the busiest link is the link's rate in
bytes/s over the largest of those figures (a host, in its busier direction) times the samples per
microbatch: no schedule can run faster through that link. It is printed with the shaped run's
ratio to it.

CPU. Each process's CPU seconds (user + system, `bench.proc_cpu`) over the same window, a step:
each stage server and the trainer by its host's name, a relay as `relay-<host>`. Unlike the
seconds a step, they hold on a host shared with other work, or with fewer cores than processes
(a process waiting for a core spends none): what a standby costs its source, and the swarm,
is read from them (bench/standby_cost.py).

Control. `--control torch` runs, after the swarm's two runs and over the same network, torch's
own pipelining (bench/torch_pipeline.py: `torch.distributed.pipelining`, gloo, one thread a
rank), each `--torch-schedule` unshaped then shaped: rank k on stage k's host (`stage<k>`, the
trainer's host idle), started one rank at a time, rank 0's address and `TORCH_PORT` the
rendezvous, gloo's links on each host's `eth0`. The same job file (its model, data, batch and
microbatches; torch always sends float32, whatever `--codec`), the same steps, timed the same
way from rank 0's step log. It prints each schedule's shaped/unshaped beside the swarm's, the
swarm's samples/s over torch's faster schedule on each link, and the bytes a microbatch on
each host's shaped link for both: the same boundaries cross the same links (a middle stage
sends and receives two boundaries a microbatch, about 2.2 MB at d256). It tells whether a
ratio below 1 is the swarm's or any synchronous pipeline's: a step's fill and drain put
2 x (stages - 1) hop transfers on the critical path, with no slack to hide them in. It needs
`--replicas 1` and `--delay-ms 0` (the delay is a relay in front of the swarm's servers).

Needs root, `ip` and `tc` (iproute2), and a kernel with namespaces, veth, bridge and tbf; says so
and exits 2 without them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, get_args, get_type_hints

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import torch_pipeline  # noqa: E402
from bench.proc_cpu import LiveStats, Stats, per_step, session_seconds  # noqa: E402
from swarm.errors import ConfigError  # noqa: E402
from swarm.job.config import CompressionConfig, RuntimeConfig, parse_job  # noqa: E402
from swarm.local.netns import Network, Proc, remove_leftovers  # noqa: E402

PREFIX = "swb-"
SUBNET = "10.77.0"
TRAINER = "trainer"
STAGES = 4


def stage_hosts(replicas: int) -> list[list[str]]:
    """Per stage, its replicas' host names: `stage<k>` with one replica each, else `s<k>r<j>`."""
    if replicas == 1:
        return [[f"stage{k}"] for k in range(STAGES)]
    return [[f"s{k}r{j}" for j in range(replicas)] for k in range(STAGES)]


def addresses(replicas: int) -> dict[str, str]:
    """Every host's address: the trainer's, then the stage servers' in stage order."""
    servers = [h for stage in stage_hosts(replicas) for h in stage]
    return {TRAINER: f"{SUBNET}.10", **{h: f"{SUBNET}.{11 + i}" for i, h in enumerate(servers)}}


STATS: Stats = LiveStats()  # where each process's CPU seconds are read (`bench.proc_cpu`)

PORT = 7000  # every stage server's (namespaces are separate, so the same port everywhere)
TORCH_PORT = 29500  # the control's rendezvous, on rank 0's host
TORCH_SCHEDULES = ["gpipe", "1f1b"]
READY_TIMEOUT_S = 300.0  # four servers importing torch at once on two cores

WORKLOADS: dict[str, dict[str, int]] = {
    # a byte-level GPT that keeps each stage busy for a while per microbatch
    "d256": dict(
        d_model=256, n_layers=8, n_heads=4, seq_len=128, microbatch_size=8, microbatches=8
    ),
    # a smoke run: seconds per step
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, seq_len=64, microbatch_size=8, microbatches=4),
}

DATA_PLANES = [str(a) for a in get_args(get_type_hints(RuntimeConfig)["data_plane"])]


# ---------------------------------------------------------------------------------------------
# The delaying relay (`wan.py --relay LISTEN UPSTREAM DELAY_MS`, run inside a namespace)

RELAY_CHUNK = 1 << 16
RELAY_QUEUE_BYTES = 64 << 20  # a direction's delay line stops reading beyond this


async def _delay_line(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float
) -> None:
    """Copy `reader` to `writer`, each chunk written `delay_s` after it was read, in order."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
    room = asyncio.Event()
    room.set()
    queued = 0

    async def send() -> None:
        nonlocal queued
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                break
            writer.write(data)
            queued -= len(data)
            if queued < RELAY_QUEUE_BYTES:
                room.set()
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

    sender = asyncio.create_task(send())
    try:
        while data := await reader.read(RELAY_CHUNK):
            queue.put_nowait((loop.time() + delay_s, data))
            queued += len(data)
            if queued >= RELAY_QUEUE_BYTES:
                room.clear()
                roomy = asyncio.ensure_future(room.wait())
                await asyncio.wait([roomy, sender], return_when=asyncio.FIRST_COMPLETED)
                roomy.cancel()
                if sender.done():
                    break
    except BaseException:
        sender.cancel()
        raise
    queue.put_nowait((loop.time() + delay_s, b""))
    await sender


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _relay(listen: str, upstream: str, delay_ms: float) -> None:
    host, port = listen.rsplit(":", 1)
    up_host, up_port = upstream.rsplit(":", 1)
    delay_s = delay_ms / 1000.0

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(up_host, int(up_port))
        except OSError:
            client_w.close()
            return
        _nodelay(client_w)
        _nodelay(up_w)
        try:
            await asyncio.gather(
                _delay_line(client_r, up_w, delay_s), _delay_line(up_r, client_w, delay_s)
            )
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            client_w.close()
            up_w.close()

    server = await asyncio.start_server(handle, host, int(port))
    print(f"swarm wan-relay ready: address={listen} upstream={upstream} delay_ms={delay_ms}")
    sys.stdout.flush()
    async with server:
        await server.serve_forever()


# ---------------------------------------------------------------------------------------------
# Namespaces and processes (`swarm.local.netns`)


def parse_rate(text: str) -> float | None:
    """tc's rate units in bits/s (SI: 1mbit = 10^6 bit/s); None for "none"."""
    if text.lower() in ("none", "0", "off"):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r}: use e.g. 100mbit, 20mbit, 500kbit or none")
    unit = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}[match.group(2)]
    return float(match.group(1)) * unit


def _bench_alive(pid: int) -> bool:
    try:
        return b"wan.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def child_env(work: Path) -> dict[str, str]:
    """This environment without SWARM_* settings or proxies (gRPC would use one), plus ours."""
    proxies = {"http_proxy", "https_proxy", "grpc_proxy", "all_proxy", "no_proxy"}
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SWARM_") and k.lower() not in proxies
    }
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), SWARM_CACHE_DIR=str(work / "cache"))
    return env


def swarm_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarm.cli", *args]


def start(net: Network, host: str, name: str, argv: list[str], work: Path) -> Proc:
    return net.start(host, name, argv, work, child_env(work), ROOT)


def job_toml(
    workload: str,
    steps: int,
    codec: str,
    data_plane: str,
    in_flight: int = 8,
    delayed_update: bool = False,
    standby: int = 0,
    averaging: str = "none",
    checkpoint_every: int = 0,
) -> str:
    p = WORKLOADS[workload]
    plane = f'data_plane = "{data_plane}"\n'
    return f"""name = "wan-{workload}"
[model]
kind = "gpt"
vocab_size = 256
d_model = {p["d_model"]}
n_layers = {p["n_layers"]}
n_heads = {p["n_heads"]}
seq_len = {p["seq_len"]}
[data]
kind = "synthetic"
[training]
stages = {STAGES}
microbatch_size = {p["microbatch_size"]}
target_batch_size = {p["microbatch_size"] * p["microbatches"]}
steps = {steps}
dtype = "float32"
checkpoint_every = {checkpoint_every}
delayed_update = {"true" if delayed_update else "false"}
[optimizer]
kind = "adamw"
lr = 1e-3
[compression]
wire = "{codec}"
averaging = "{averaging}"
[runtime]
max_in_flight = {in_flight}
standby = {standby}
{plane}"""


def count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


@dataclass
class Measured:
    samples_per_s: float
    seconds: float
    steps: int
    microbatches: int
    trainer_samples_per_s: float  # what the trainer's log says for the same steps
    blocked_seconds_per_step: float  # the coordinator's, waiting on commits (the trainer's log)
    bytes_per_microbatch: dict[str, dict[str, float]]  # host -> sent/received
    # process -> its CPU seconds a step over the same window (`bench.proc_cpu`): each host's
    # stage server or trainer by the host's name, a delay's relay as `relay-<host>`
    cpu_seconds_per_step: dict[str, float]


def run_once(
    net: Network,
    job: Path,
    work: Path,
    label: str,
    args: argparse.Namespace,
    shaped: bool,
    procs: list[Proc],
) -> Measured:
    """Fresh stage servers (and relays), one trainer; measured between the warm-up step's end and
    the last step's end. Every process is killed before this returns."""
    p = WORKLOADS[args.workload]
    relayed = shaped and args.delay_ms > 0
    net.shape(args.rate_bits if shaped else None)
    start_at = len(procs)
    hosts, address = stage_hosts(args.replicas), net.addresses
    servers = [(k, host) for k, stage in enumerate(hosts) for host in stage]
    sessions: dict[str, int] = {}  # each process's session (its pid: a session of its own)
    try:
        for k, host in servers:
            listen = "127.0.0.1" if relayed else address[host]
            flags = f"--stage {k} --host {listen} --port {PORT} --device cpu --threads 1"
            flags += " --insecure-no-token"  # a lab of namespaces on this machine alone
            argv = swarm_cmd("stage-server", "--job", str(job), *flags.split())
            procs.append(start(net, host, f"{label}-{host}", argv, work))
            sessions[host] = procs[-1].popen.pid
        deadline = time.monotonic() + READY_TIMEOUT_S
        for proc in procs[start_at:]:
            proc.wait_ready(deadline)
        if relayed:
            for _, host in servers:
                relay = [sys.executable, str(Path(__file__).resolve()), "--relay"]
                relay += [f"{address[host]}:{PORT}", f"127.0.0.1:{PORT}", str(args.delay_ms)]
                procs.append(start(net, host, f"{label}-relay-{host}", relay, work))
                sessions[f"relay-{host}"] = procs[-1].popen.pid
            deadline = time.monotonic() + 60
            for proc in procs[start_at + len(servers) :]:
                proc.wait_ready(deadline)
        log = work / f"{label}-steps.jsonl"
        stage_servers = ",".join(
            "|".join(f"{address[host]}:{PORT}" for host in stage) for stage in hosts
        )
        argv = swarm_cmd("trainer", "--job", str(job), "--threads", "1", "--log", str(log))
        if args.checkpoint_every:  # each stage's state downloaded over its host's uplink
            argv += ["--checkpoint-dir", str(work / f"{label}-checkpoints")]
        trainer = start(
            net, TRAINER, f"{label}-trainer", [*argv, "--stage-servers", stage_servers], work
        )
        procs.append(trainer)
        sessions[TRAINER] = trainer.popen.pid
        # the job has one step more: see the module's docstring
        window = watch(
            net, log, procs[start_at:], trainer, label, args.steps + 1, args.timeout, sessions
        )
    finally:
        for proc in procs[start_at:]:
            proc.kill()
        del procs[start_at:]
    return measured(window, log, p, list(net.addresses))


def torch_argvs(job: Path, steps: int, schedule: str, log: Path) -> dict[str, list[str]]:
    """The control's command lines by host: rank k of bench/torch_pipeline.py on stage k's
    host (one thread, as each stage server), all meeting at rank 0's address; rank 0 logs the
    steps to `log`."""
    hosts, address = stage_hosts(1), addresses(1)
    rank0 = address[hosts[0][0]]
    return {
        stage[0]: torch_pipeline.rank_argv(job, k, rank0, TORCH_PORT, steps, schedule, 1, log)
        for k, stage in enumerate(hosts)
    }


def torch_env(work: Path) -> dict[str, str]:
    """A rank's environment: gloo's links on the host's own device (a namespace's name resolves
    to nothing usable), one OpenMP thread."""
    return {**child_env(work), "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}


def run_torch(
    net: Network,
    job: Path,
    work: Path,
    label: str,
    args: argparse.Namespace,
    shaped: bool,
    schedule: str,
    procs: list[Proc],
) -> Measured:
    """The control: torch pipelining's ranks (bench/torch_pipeline.py), each on a stage
    server's host, over the same links, timed as `run_once` times the swarm (the same job: one
    warm-up step, the timed ones, one more while the counters are read). Every rank is killed
    before this returns."""
    net.shape(args.rate_bits if shaped else None)
    start_at = len(procs)
    log = work / f"{label}-steps.jsonl"
    try:
        for host, argv in torch_argvs(job, args.steps + 2, schedule, log).items():
            procs.append(net.start(host, f"{label}-{host}", argv, work, torch_env(work), ROOT))
        rank0 = procs[start_at]
        ranks = {f"rank{k}": proc.popen.pid for k, proc in enumerate(procs[start_at:])}
        window = watch(
            net, log, procs[start_at:], rank0, label, args.steps + 1, args.timeout, ranks
        )
    finally:
        for proc in procs[start_at:]:
            proc.kill()
        del procs[start_at:]
    return measured(window, log, WORKLOADS[args.workload], list(net.addresses))


@dataclass
class Window:
    """The timed steps: from the warm-up step's end (its log line seen) to the last one's, each
    end's time, log lines and every host's link counters (sent, received)."""

    start: float
    end: float
    lines: tuple[int, int]
    counters: tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]
    cpu: tuple[dict[str, float], dict[str, float]]  # each watched session's CPU seconds so far


def watch(
    net: Network,
    log: Path,
    procs: list[Proc],
    told: Proc,
    label: str,
    total: int,
    timeout: float,
    sessions: dict[str, int],
) -> Window:
    """Poll `log` (a line a step) until `total` steps are in it, the link counters and the CPU
    of `sessions` (name -> session id) read as the first line and the `total`th appear; a
    process of `procs` that exits, or `timeout` seconds passing, raises with its log's tail
    (`told`'s on a timeout: the one writing `log`)."""
    deadline = time.monotonic() + timeout
    first: tuple[float, int, dict[str, tuple[int, int]], dict[str, float]] | None = None
    while True:
        done = count_lines(log)
        if first is None and done >= 1:
            first = (time.monotonic(), done, net.counters(), session_seconds(STATS, sessions))
        if first is not None and done >= total:
            end, counters = time.monotonic(), net.counters()
            cpu = (first[3], session_seconds(STATS, sessions))
            return Window(first[0], end, (first[1], done), (first[2], counters), cpu)
        for proc in procs:
            if proc.popen.poll() is not None:
                raise RuntimeError(
                    f"{proc.name} exited with {proc.popen.returncode} during the {label} "
                    f"run:\n{proc.log()[-3000:]}"
                )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the {label} run did not finish {total} steps in {timeout:.0f}s "
                f"({done} done); {told.name}'s log:\n{told.log()[-3000:]}"
            )
        time.sleep(0.01)


def measured(window: Window, log: Path, p: dict[str, int], hosts: list[str]) -> Measured:
    """A run's figures over `window`: samples/s by the wall clock; by the log's own seconds
    (its lines `samples`, `seconds`, `blocked_seconds` if any) over the same steps; and each
    host's bytes each way per microbatch."""
    done0, done_end = window.lines
    c0, end_counters = window.counters
    cpu0, end_cpu = window.cpu
    records = [json.loads(line) for line in log.read_text().splitlines()][done0:done_end]
    steps = done_end - done0
    microbatches = steps * p["microbatches"]
    seconds = window.end - window.start
    samples = steps * p["microbatch_size"] * p["microbatches"]
    per_mb = {
        h: {
            "sent": (end_counters[h][0] - c0[h][0]) / microbatches,
            "received": (end_counters[h][1] - c0[h][1]) / microbatches,
        }
        for h in hosts
    }
    return Measured(
        samples_per_s=samples / seconds,
        seconds=seconds,
        steps=steps,
        microbatches=microbatches,
        trainer_samples_per_s=sum(r["samples"] for r in records)
        / sum(r["seconds"] for r in records),
        blocked_seconds_per_step=sum(r.get("blocked_seconds", 0.0) for r in records) / len(records),
        bytes_per_microbatch=per_mb,
        cpu_seconds_per_step=per_step(cpu0, end_cpu, steps),
    )


# ---------------------------------------------------------------------------------------------
# Report


LINKS = ("unshaped", "shaped")


def added_seconds(runs: dict[str, Measured]) -> float:
    """Seconds a step the shaped run took over the unshaped one."""
    return runs["shaped"].seconds / runs["shaped"].steps - (
        runs["unshaped"].seconds / runs["unshaped"].steps
    )


def control_figures(
    swarm: dict[str, Measured], torch: dict[str, dict[str, Measured]]
) -> dict[str, Any]:
    """The torch control's figures beside the swarm's (`swarm` and each schedule's runs by
    link): each schedule's runs, shaped/unshaped and the seconds a step the links add (a
    pipeline's fill and drain, if that is what they cost, add the same whatever the compute's
    speed, which moves the ratio); on each link the faster schedule (as bench/peer_workload.py
    holds a swarm against the faster), torch's shaped/unshaped by those, and the swarm's
    samples/s over them."""
    best = {
        link: max(
            ((s, runs[link].samples_per_s) for s, runs in torch.items()), key=lambda sr: sr[1]
        )
        for link in LINKS
    }
    return {
        "schedules": {
            s: {
                **{link: vars(runs[link]) for link in LINKS},
                "shaped_over_unshaped": runs["shaped"].samples_per_s
                / runs["unshaped"].samples_per_s,
                "added_seconds_per_step": added_seconds(runs),
            }
            for s, runs in torch.items()
        },
        "swarm_added_seconds_per_step": added_seconds(swarm),
        "best": {link: {"schedule": s, "samples_per_s": v} for link, (s, v) in best.items()},
        "shaped_over_unshaped": best["shaped"][1] / best["unshaped"][1],
        "swarm_over_torch": {link: swarm[link].samples_per_s / best[link][1] for link in LINKS},
    }


def report(
    args: argparse.Namespace,
    unshaped: Measured,
    shaped: Measured,
    torch: dict[str, dict[str, Measured]] | None = None,
) -> dict[str, Any]:
    """The run's figures; `torch`: the control's runs by schedule and link, if it ran."""
    p = WORKLOADS[args.workload]
    out: dict[str, Any] = {
        "workload": {"name": args.workload, **p, "stages": STAGES, "dtype": "float32"},
        "rate": args.rate,
        "rate_bits_per_s": args.rate_bits,
        "delay_ms": args.delay_ms,
        "codec": args.codec,
        "averaging": args.averaging,
        "data_plane": args.data_plane,
        "replicas": args.replicas,
        "delayed_update": args.delayed_update,
        "standby": args.standby,
        "checkpoint_every": args.checkpoint_every,
        "timed_steps": args.steps,
        "addresses": addresses(args.replicas),
        "unshaped": vars(unshaped),
        "shaped": vars(shaped),
        "shaped_over_unshaped": shaped.samples_per_s / unshaped.samples_per_s,
        "bound": None,
        "shaped_over_bound": None,
        "torch": None,
    }
    if torch:
        out["torch"] = control_figures({"unshaped": unshaped, "shaped": shaped}, torch)
    if args.rate_bits is not None:
        host, direction = max(
            ((h, d) for h in out["addresses"] for d in ("sent", "received")),
            key=lambda hd: shaped.bytes_per_microbatch[hd[0]][hd[1]],
        )
        busiest = shaped.bytes_per_microbatch[host][direction]
        bound = args.rate_bits / 8 / busiest * p["microbatch_size"]
        out["bound"] = {
            "host": host,
            "direction": direction,
            "bytes_per_microbatch": busiest,
            "link_bytes_per_s": args.rate_bits / 8,
            "samples_per_s": bound,
        }
        out["shaped_over_bound"] = shaped.samples_per_s / bound
    return out


def mb(n: float) -> str:
    return f"{n / 1e6:.3f} MB"


def print_report(r: dict[str, Any], out: IO[str]) -> None:
    w = r["workload"]
    standby = f", {r['standby']} of them standby" if r.get("standby") else ""
    print(
        f"workload {w['name']}: gpt d_model {w['d_model']}, {w['n_layers']} blocks, "
        f"{w['n_heads']} heads, seq {w['seq_len']}, {w['stages']} stages; "
        f"{w['microbatch_size']} samples x {w['microbatches']} microbatches per step, "
        f"{w['dtype']}; wire {r['codec']}, averaging {r.get('averaging', 'none')}, data plane "
        f"{r['data_plane']}; "
        f"{r['replicas']} replica(s) per stage{standby}"
        f"{', delayed_update' if r['delayed_update'] else ''}",
        file=out,
    )
    print(
        f"link: {r['rate']} each way per host, one-way delay {r['delay_ms']:g} ms; "
        f"{r['timed_steps']} timed steps after 1 warm-up",
        file=out,
    )
    print(
        f"{'run':<10} {'samples/s':>10} {'s/step':>8} {'blocked s/step':>15} "
        f"{'trainer log samples/s':>22}",
        file=out,
    )
    for name in ("unshaped", "shaped"):
        m = r[name]
        print(
            f"{name:<10} {m['samples_per_s']:>10.2f} {m['seconds'] / m['steps']:>8.2f} "
            f"{m['blocked_seconds_per_step']:>15.3f} {m['trainer_samples_per_s']:>22.2f}",
            file=out,
        )
    print(f"shaped/unshaped {r['shaped_over_unshaped']:.3f}", file=out)
    print(
        "bytes per microbatch on each host's link (as tbf counts them, segment headers included)",
        file=out,
    )
    print(
        f"{'host':<8} {'address':<11} {'sent':>12} {'received':>12}   "
        f"{'unshaped sent':>13} {'received':>12}   {'CPU s/step':>10} {'unshaped':>9}",
        file=out,
    )
    cpu = {name: r[name].get("cpu_seconds_per_step", {}) for name in ("shaped", "unshaped")}
    for h in r["addresses"]:
        s, u = r["shaped"]["bytes_per_microbatch"][h], r["unshaped"]["bytes_per_microbatch"][h]
        print(
            f"{h:<8} {r['addresses'][h]:<11} {mb(s['sent']):>12} {mb(s['received']):>12}   "
            f"{mb(u['sent']):>13} {mb(u['received']):>12}   "
            f"{cpu['shaped'].get(h, float('nan')):>10.3f} "
            f"{cpu['unshaped'].get(h, float('nan')):>9.3f}",
            file=out,
        )
    print_bound(r, out)
    if r.get("torch"):
        print_control(r, out)


def print_bound(r: dict[str, Any], out: IO[str]) -> None:
    w, b = r["workload"], r["bound"]
    if b is None:
        print("bound: none (the links are not rate-limited)", file=out)
        return
    print(
        f"busiest link: {b['host']} {b['direction']} {mb(b['bytes_per_microbatch'])} per "
        f"microbatch; bound {b['link_bytes_per_s'] / 1e6:.3f} MB/s / "
        f"{mb(b['bytes_per_microbatch'])} x {w['microbatch_size']} samples = "
        f"{b['samples_per_s']:.2f} samples/s",
        file=out,
    )
    print(f"shaped/bound {r['shaped_over_bound']:.3f}", file=out)


def print_control(r: dict[str, Any], out: IO[str]) -> None:
    """The torch control beside the swarm: its runs, both shaped/unshaped, swarm/torch on each
    link, and the bytes a microbatch on each host's shaped link (the same boundaries?)."""
    c = r["torch"]
    schedules = list(c["schedules"])
    print(
        "control: torch pipelining (bench/torch_pipeline.py), rank k on stage k's host, gloo, "
        "the same links",
        file=out,
    )
    print(
        f"{'run':<10} {'schedule':<9} {'samples/s':>10} {'s/step':>8} {'torch log samples/s':>20}",
        file=out,
    )
    for s in schedules:
        for link in LINKS:
            m = c["schedules"][s][link]
            print(
                f"{link:<10} {s:<9} {m['samples_per_s']:>10.2f} {m['seconds'] / m['steps']:>8.2f} "
                f"{m['trainer_samples_per_s']:>20.2f}",
                file=out,
            )
    each = ", ".join(f"{s} {c['schedules'][s]['shaped_over_unshaped']:.3f}" for s in schedules)
    print(
        f"shaped/unshaped: swarm {r['shaped_over_unshaped']:.3f}; torch {each}; torch's faster "
        f"on each link {c['shaped_over_unshaped']:.3f}",
        file=out,
    )
    ratio = ", ".join(
        f"{link} {c['swarm_over_torch'][link]:.3f} ({c['best'][link]['schedule']})"
        for link in LINKS
    )
    print(f"swarm/torch (torch's faster schedule on each link): {ratio}", file=out)
    added = ", ".join(f"{s} {c['schedules'][s]['added_seconds_per_step']:+.2f}" for s in schedules)
    print(
        f"s/step the links add: swarm {c['swarm_added_seconds_per_step']:+.2f}; torch {added}",
        file=out,
    )
    print("bytes per microbatch on each host's shaped link", file=out)
    names = ["swarm", *(f"torch {s}" for s in schedules)]
    print(f"{'':<8}" + "".join(f" {n:>25}" for n in names), file=out)
    print(f"{'host':<8}" + f" {'sent':>12} {'received':>12}" * len(names), file=out)
    runs = [r["shaped"], *(c["schedules"][s]["shaped"] for s in schedules)]
    for h in r["addresses"]:
        cells = [m["bytes_per_microbatch"][h] for m in runs]
        print(
            f"{h:<8}" + "".join(f" {mb(x['sent']):>12} {mb(x['received']):>12}" for x in cells),
            file=out,
        )


# ---------------------------------------------------------------------------------------------


def schedules(text: str) -> list[str]:
    """`--torch-schedule`: one or more of TORCH_SCHEDULES, each once, in the order given."""
    names = [n.strip() for n in text.split(",")]
    unknown = [n for n in names if n not in TORCH_SCHEDULES]
    if unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: one or more of {', '.join(TORCH_SCHEDULES)}, each once"
        )
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rate", default="100mbit", help="each host's link rate, each way: 100mbit, 20mbit, none"
    )
    parser.add_argument(
        "--delay-ms", type=float, default=0.0, help="one-way delay to each stage server (ms)"
    )
    parser.add_argument(
        "--codec",
        default="none",
        choices=[str(a) for a in get_args(get_type_hints(CompressionConfig)["wire"])],
        help="[compression] wire: the tensor codec on the wire",
    )
    parser.add_argument(
        "--averaging",
        default="none",
        choices=[str(a) for a in get_args(get_type_hints(CompressionConfig)["averaging"])],
        help="[compression] averaging: the pools' codec (a standby's updates come in it)",
    )
    parser.add_argument(
        "--data-plane", default="push", choices=DATA_PLANES, help="runtime.data_plane of the job"
    )
    parser.add_argument(
        "--max-in-flight", type=int, default=8, help="runtime.max_in_flight: the trainer's window"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps (plus 1 warm-up)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="d256")
    parser.add_argument("--small", action="store_true", help="the same as --workload tiny")
    parser.add_argument("--replicas", type=int, default=1, help="replicas per stage (pools)")
    parser.add_argument(
        "--delayed-update",
        action="store_true",
        help="training.delayed_update: each step's averaging overlaps the next step",
    )
    parser.add_argument(
        "--standby", type=int, default=0, help="runtime.standby: of each stage's --replicas"
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="training.checkpoint_every: the trainer downloads every stage's state mid-job",
    )
    parser.add_argument(
        "--control",
        choices=["none", "torch"],
        default="none",
        help="torch: also run torch pipelining's ranks on the stage hosts, unshaped and shaped",
    )
    parser.add_argument(
        "--torch-schedule",
        type=schedules,
        default=TORCH_SCHEDULES,
        help="the control's schedules, comma-separated: gpipe, 1f1b (default both)",
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds each run may take at most"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the work directory (printed)"
    )
    parser.add_argument("--relay", nargs=3, help=argparse.SUPPRESS)  # LISTEN UPSTREAM DELAY_MS
    args = parser.parse_args(argv)
    if args.small:
        args.workload = "tiny"
    return args


def check(args: argparse.Namespace) -> str | None:
    """Why this cannot run, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, bridge, tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} (iproute2) on PATH"
    return refused(args)


def refused(args: argparse.Namespace) -> str | None:
    """Why these options cannot run, or None; sets `args.rate_bits`."""
    try:
        args.rate_bits = parse_rate(args.rate)
    except argparse.ArgumentTypeError as e:
        return f"--rate {e}"
    if args.steps < 1:
        return "--steps must be at least 1"
    if not 1 <= args.replicas <= 8:
        return "--replicas must be in 1..8"
    if args.delay_ms < 0:
        return "--delay-ms must be >= 0"
    if not 0 <= args.standby < args.replicas:
        return "--standby must be in 0..replicas-1 (a stage keeps a replica)"
    if args.control == "torch" and args.replicas != 1:
        return "--control torch needs --replicas 1 (torch pipelining runs one process a stage)"
    if args.control == "torch" and args.delay_ms > 0:
        return "--control torch needs --delay-ms 0 (the delaying relay is the swarm servers')"
    try:
        parse_job(
            job_toml(
                args.workload,
                2,
                args.codec,
                args.data_plane,
                args.max_in_flight,
                checkpoint_every=args.checkpoint_every,
            ),
            ROOT,
            "wan",
        )
    except ConfigError as e:
        return f"the job would not load: {e}"
    return None


def main() -> int:
    args = parse_args()
    if args.relay:
        listen, upstream, delay = args.relay
        asyncio.run(_relay(listen, upstream, float(delay)))
        return 0
    problem = check(args)
    if problem:
        print(f"bench/wan.py: {problem}", file=sys.stderr)
        return 2

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    work = Path(tempfile.mkdtemp(prefix="swarm-wan-"))
    net = Network(PREFIX, addresses(args.replicas))
    procs: list[Proc] = []
    result: dict[str, Any] | None = None
    status = 1
    try:
        removed = remove_leftovers(PREFIX, _bench_alive)
        if removed:
            print(f"removed leftover namespaces: {', '.join(removed)}", file=sys.stderr)
        try:
            net.create()
            net.shape(args.rate_bits)  # fail here, not after a run, if tbf is missing
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"bench/wan.py: cannot build the network: {e}", file=sys.stderr)
            status = 2
            return status
        job = work / "job.toml"
        toml = job_toml(
            args.workload,
            args.steps + 2,
            args.codec,
            args.data_plane,
            args.max_in_flight,
            args.delayed_update,
            args.standby,
            args.averaging,
            args.checkpoint_every,
        )
        job.write_text(toml)
        print(f"unshaped run (1 + {args.steps} + 1 steps) ...", file=sys.stderr, flush=True)
        unshaped = run_once(net, job, work, "unshaped", args, False, procs)
        print(f"shaped run ({args.rate}, {args.delay_ms:g} ms) ...", file=sys.stderr, flush=True)
        shaped = run_once(net, job, work, "shaped", args, True, procs)
        torch: dict[str, dict[str, Measured]] = {}
        for schedule in args.torch_schedule if args.control == "torch" else []:
            torch[schedule] = {}
            for link in LINKS:
                print(f"torch {schedule} {link} run ...", file=sys.stderr, flush=True)
                label = f"torch-{schedule}-{link}"
                torch[schedule][link] = run_torch(
                    net, job, work, label, args, link == "shaped", schedule, procs
                )
        result = report(args, unshaped, shaped, torch)
        status = 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        status = 130
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as e:
        print(f"bench/wan.py: {e}", file=sys.stderr)
        status = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for proc in procs:
            proc.kill()
        net.destroy()
        if status in (0, 2) and not args.keep_logs:  # 2: nothing ran
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"logs in {work}", file=sys.stderr)
    if result is not None:
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print_report(result, sys.stdout)
    return status


if __name__ == "__main__":
    sys.exit(main())
