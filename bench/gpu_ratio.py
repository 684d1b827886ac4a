"""Swarm against single-process torch on the same device, in one run (issue 53): part of
bench/gpu_check.sh.

    python bench/gpu_ratio.py [--device cuda:0] [--shapes long,short] [--warmup 2] [--steps 5]
        [--precision bf16-mixed] [--compile auto|on|off] [--peak-tflops T] [--cpu-tiny] [--mps]
        [--smoke] [--stall-s S] [--budget-s S] [--server-faults [stageK:]point@step,...]
        [--out DIR] [--py-spy]

The model is examples/llama-1b.toml's. Each run is its own process, one after the other on the
one device, swarm's first, warm-up steps and then timed steps:
  (a) torch, microbatched: one process, the same model, batch, microbatches, data and precision
      as swarm (`loss.backward()` per microbatch, one optimizer step), eager and (CUDA) compiled;
      eager bf16-mixed with swarm's own weight copies and sums (`swarm.model.low_copies`);
  (b) torch, one pass: the same, the step's whole batch in one forward and backward;
  (c) swarm: one stage server per stage, all on the device, and the standalone trainer; on
      CUDA once more with the servers' `--compile-stage`.
Ratios are against the faster torch run of each kind, so a baseline never gets fewer
optimizations than swarm. Shapes: `short`, the device check's [4, 16] x seq 128; `long`, seq
1024 with 8 sequences (8k tokens) a microbatch, 4 microbatches a step.

Per run: tokens/s, p50 and p90 step seconds (timed steps), MFU (model FLOPs with attention's
counted, as `swarm.model.transformer.layer_costs`, x3 for the backward, against `--peak-tflops`
or the device's known dense bf16 peak; n/a when unknown), the device's busy % (NVML's
utilization, sampled while the timed steps ran; n/a without NVML), and for swarm the commit's
share of a step (what no microbatch could be leased in), the activation caches' evictions, and
every step's loss against (a)'s (within 1% in bf16-mixed, 1e-4 in fp32), and where its time
went: every process of a swarm run writes its timeline (`swarm.ops.timeline`), cut into the
timed steps by `bench.timeline_report` (a table after the runs' one: the seconds some stage
computed and none did, the idle cut into fill, gaps, drain and commit, the evictions by cause),
and a trace of the run for Perfetto (`--out DIR` keeps it). `--py-spy`: each stage server
sampled by py-spy over the timed steps (`bench.spy`), what its threads spent their time in
printed, the stacks kept (`--out`). A one-pass run the
device has no memory for is reported (OOM), not failed. The last line is `RESULT {json}`; exit
status 1 when a run failed or a loss disagreed.

Each run is a process group ended whole, its stage servers with it (`bench.process_groups`), at
its timeout, or once swarm's commits no step for `--stall-s` (`bench.stall`): a stall prints the
trainer's last errors and each server's, and no run after it starts. Before the next run the
device's memory is back where it was, said in a line. `--budget-s`: no run starts past it (a run
it ends is "not run", not failed). `--smoke`: swarm alone, 2 steps, each server's INFO log
printed (the device check's first part). `--server-faults`: the servers' SWARM_FAULTS, a stall
on purpose (`handover-refuse@0`: every handover refused, as b8f54b2's CUDA handover did).

`--cpu-tiny`: a few layers of width 64 on the CPU, as on a device: bf16-mixed, real `swarm
stage-server` processes 4 x 1, the co-located handover between them (shared memory here); CI
runs it (tests/system/test_gpu_ratio.py; the device check's quick part in fp32).
`--mps`: (c) once more with NVIDIA's MPS daemon running (bench/mps.py), its tokens/s against (c)'s
in the same run; where the host cannot run it, "MPS A/B: not available" and why.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import process_groups, spy, timeline_report  # noqa: E402
from bench.gpu_check import BF16_PEAK_TFLOPS  # noqa: E402
from bench.llama_job import JOB, TINY, set_keys  # noqa: E402
from bench.mps import MpsUnavailable, mps_daemon, mps_unavailable  # noqa: E402
from bench.stall import READY_LINE, STEP_LINE, Stall, last_errors  # noqa: E402
from swarm.ops import timeline  # noqa: E402

SHAPES: dict[str, dict[str, int]] = {  # seq_len, microbatch_size, target_batch_size
    "short": {"seq_len": 128, "microbatch_size": 4, "target_batch_size": 16},
    "long": {"seq_len": 1024, "microbatch_size": 8, "target_batch_size": 32},
}
TINY_SHAPES: dict[str, dict[str, int]] = {
    "short": {"seq_len": 32, "microbatch_size": 2, "target_batch_size": 8},
    "long": {"seq_len": 128, "microbatch_size": 4, "target_batch_size": 8},
}
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16-mixed": 1e-2}  # relative, every step, swarm against (a)
PHASE_TIMEOUT_S = 600.0
STALL_S = {"smoke": 40.0, "eager": 120.0, "compiled": 240.0}  # no committed step: stop (item 7)
MIN_PHASE_S = 20.0  # a phase is not started with less of --budget-s left
SERVER_LOG_LINES = 60  # of each stage server's INFO log, printed by --smoke and on a failure


def job_text(args: argparse.Namespace, shape: str) -> str:
    text = JOB.read_text().replace(
        'path = "data/corpus.txt"', f'path = "{JOB.parent}/data/corpus.txt"'
    )
    keys: dict[str, object] = dict(TINY) | {"n_kv_heads": 2} if args.cpu_tiny else {}
    keys |= (TINY_SHAPES if args.cpu_tiny else SHAPES)[shape]
    keys |= {
        "steps": args.warmup + args.steps,
        "precision": f'"{args.precision}"',
        "checkpoint_every": 0,
    }
    return set_keys(text, keys)


# --- a run, in its own process ------------------------------------------------------------------


class Busy:
    """The device's utilization (NVML, %) sampled every 50 ms between `start` and `stop`; None
    without NVML (a CPU, or no nvidia-ml-py)."""

    def __init__(self, device: str) -> None:
        self.samples: list[int] = []
        self.times: list[float] = []  # each sample's time (perf_counter: the timeline's clock)
        self._handle: Any = None
        self._done = threading.Event()
        if device.startswith("cuda"):
            try:
                import pynvml  # type: ignore[import-not-found]

                pynvml.nvmlInit()
                index = int(device.partition(":")[2] or 0)
                visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
                if visible and visible.split(",")[index].isdigit():
                    index = int(visible.split(",")[index])
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                self._read = lambda: pynvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
            except Exception:
                self._handle = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.wait(0.05):
            self.samples.append(int(self._read()))
            self.times.append(time.perf_counter())

    def start(self) -> None:
        if self._handle is not None:
            self._thread.start()

    def stop(self) -> float | None:
        if self._handle is None:
            return None
        if not self._done.is_set():
            self._done.set()
            self._thread.join()
        return statistics.fmean(self.samples) if self.samples else None

    def timed(self) -> list[tuple[float, int]]:
        return list(zip(self.times, self.samples, strict=False))


def run_torch(args: argparse.Namespace, job_path: Path, compiled: bool, one_pass: bool) -> dict:
    """(a) or (b): the job trained in this process; each step's loss and seconds."""
    import torch

    from swarm.device.facts import apply_matmul_precision
    from swarm.job.config import load_job
    from swarm.model.data import make_data
    from swarm.model.low_copies import LowCopies
    from swarm.model.optim import build_optimizer, update
    from swarm.model.transformer import build_model, loss_sum, precision

    job, device = load_job(job_path), torch.device(args.device)
    if args.cpu_tiny:
        torch.set_num_threads(1)  # as each stage server (--threads 1): a like-for-like CPU
    apply_matmul_precision(job.training.tf32, device)
    model = build_model(job, device)
    params = list(model.parameters())
    optimizer = build_optimizer(params, job.optimizer)
    run = torch.compile(model) if compiled else model
    low = None if compiled else LowCopies.of(job)  # bf16 grads straight into the fp32 sums
    data, m = make_data(job), job.training.microbatches_per_step
    losses, seconds, busy = [], [], Busy(args.device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for step in range(job.training.steps):
        if step == args.warmup:
            busy.start()
        sync()
        start = time.perf_counter()
        batches = [data.microbatch(step, i) for i in range(m)]
        if one_pass:
            batches = [(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))]
        total, samples = torch.zeros((), device=device), 0
        for inputs, targets in batches:
            inputs, targets = inputs.to(device), targets.to(device)
            with precision(job, device):  # eager bf16-mixed: swarm's weight copies too
                loss = loss_sum(low.call(model, (inputs,)) if low else run(inputs), targets)
            with low.into_grads() if low else contextlib.nullcontext():
                loss.backward()
            total += loss.detach()
            samples += int(inputs.shape[0])
        for p in params:
            assert p.grad is not None
            p.grad.div_(samples)
        if job.training.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, job.training.grad_clip)
        update(optimizer, job, step)
        losses.append(float(total) / samples)  # a synchronization
        sync()
        seconds.append(time.perf_counter() - start)
    return {"losses": losses, "seconds": seconds, "busy": busy.stop()}


def server_logs(work: Path, shape: str, phase: str) -> list[Path]:
    """The stage servers' logs of one swarm phase (`run_swarm` names them so)."""
    return sorted(work.glob(f"{shape}-{phase}-stage-*.log"))


def server_env(faults: str, stage: int) -> dict[str, str]:
    """SWARM_FAULTS for stage server `stage` from `--server-faults` (`stageK:point@step` for
    that server alone, `point@step` for every one): the run's stalls, on purpose."""
    from swarm.ops.faults import ENV, Fault, parse_faults

    chosen = (f for f in parse_faults(faults) if f.target in ("", f"stage{stage}"))
    mine = [str(Fault("", f.point, f.step, f.period)) for f in chosen]
    return {ENV: ",".join(mine)} if mine else {}


def run_swarm(args: argparse.Namespace, job_path: Path, work: Path, compiled: bool) -> dict:
    """(c): one stage server per stage on the device, each a `swarm stage-server` process of
    its own as a user starts it (on a CPU too: the handover between them is the co-located
    one, shared memory there, CUDA IPC on a GPU), the standalone trainer in this process. Its
    output says when the servers serve and each step it commits (`bench.stall`)."""
    from bench.handover import handed
    from client.standalone import train_standalone
    from swarm.device.facts import read_evictions
    from swarm.job.config import load_job
    from swarm.local import procs
    from swarm.local.procs import SwarmProcess, spawn, start_process, stop_all
    from swarm.ops.progress import StepRecord
    from swarm.rpc.lease import Replica

    procs.launcher = spawn  # never forked from a server of the tests (bench/forked_servers.py)
    job = load_job(job_path)
    servers: list[SwarmProcess] = []
    records: list[StepRecord] = []
    busy = Busy(args.device)
    spied: list[spy.Sampling] = []  # --py-spy: the servers sampled over the timed steps
    ended: list[float] = []  # when the last step was committed

    def on_step(record: StepRecord) -> None:
        records.append(record)
        print(f"{STEP_LINE}{record.step} loss {record.loss:.6f} {record.seconds:.3f} s", flush=True)
        if len(records) == args.warmup:
            busy.start()
            if args.py_spy:  # as long as the timed steps should take, by the warm-up's
                took = statistics.fmean(r.seconds for r in records[1:] or records)
                seconds = min(max(2.0, took * args.steps), 60.0)
                pids = {f"stage {k}": s.proc.pid for k, s in enumerate(servers)}
                spied.append(spy.Sampling(pids, seconds, work))
        if len(records) == args.warmup + args.steps:  # not the state's download after it
            busy.stop()
            ended.append(time.perf_counter())

    # Every process of the run writes where its time went (`swarm.ops.timeline`): the servers
    # inherit the folder with this process's environment.
    lines = work / f"timeline-{args.shape}-{args.phase}"
    os.environ[timeline.ENV] = str(lines)
    roles = {os.getpid(): "trainer"}

    try:
        for k in range(job.training.stages):
            cmd = ["--log-level", "INFO", "stage-server", "--job", str(job_path)]
            cmd += ["--stage", str(k), "--port", "0", "--metrics-port", "0"]
            cmd += ["--device", args.device] + (["--threads", "1"] if args.cpu_tiny else [])
            cmd += ["--compile-stage"] if compiled else []
            name = f"{args.shape}-{args.phase}-stage-{k}"
            env = server_env(args.server_faults, k)
            servers.append(start_process(cmd, log_dir=work, name=name, env=env))
            roles[servers[-1].proc.pid] = f"stage {k}"
        for s in servers:
            s.wait_ready(PHASE_TIMEOUT_S)
        print(f"{READY_LINE}: {len(servers)} stage servers on {args.device}", flush=True)
        pool = [[Replica(s.address, s.address)] for s in servers]
        if args.warmup == 0:
            busy.start()
        asyncio.run(train_standalone(job, pool, on_step=on_step))
        used = busy.stop()
        # the trained state's download from the servers, after the last step: no step's time,
        # and the device idle (NVML's busy % is sampled over the timed steps alone)
        download = time.perf_counter() - ended[0] if ended else None
        taken = handed(servers)  # the co-located handover's tensors, through memory
        for sampling in spied:
            sampling.finish()
    finally:
        stop_all(servers)  # SIGTERM to each before waiting for any: their shutdowns overlap
    evictions = [read_evictions(s.log()) for s in servers]
    sampled = spied[0] if spied else None
    said = [] if sampled is None or not args.py_spy else [sampled.why] if sampled.why else []
    if sampled is not None and sampled.files:
        for name, path in sampled.files.items():
            said += spy.summary(name, path)
        stacks = spy.merged(sampled.files, work / f"py-spy-{args.shape}-{args.phase}.txt")
        said.append(f"the stacks: {stacks}")
    return {
        "losses": [r.loss for r in records],
        "seconds": [r.seconds for r in records],
        "blocked": [r.blocked_seconds for r in records],
        "busy": used,
        "evictions": evictions,
        "handed": taken,
        "timeline": timed_breakdown(args, lines, roles, busy.timed()),
        "py_spy": said,
        "state_download_s": download,
    }


def timed_breakdown(
    args: argparse.Namespace, lines: Path, roles: dict[int, str], busy: list[tuple[float, int]]
) -> dict[str, Any]:
    """The timed steps' breakdown (`bench.timeline_report`), and the whole run as a trace
    for Perfetto beside the run's logs."""
    events = timeline_report.load(lines)
    trace = lines.parent / f"trace-{args.shape}-{args.phase}.json"
    trace.write_text(json.dumps(timeline_report.chrome_trace(events, roles)))
    steps = list(range(args.warmup, args.warmup + args.steps))
    report = timeline_report.breakdown(events, roles, steps, busy)
    return {
        "mean": report["mean"],
        "evictions": report["evictions"],
        "markdown": timeline_report.markdown(report),
        "trace": str(trace),
        "steps": [{k: v for k, v in r.items() if k != "per_stage"} for r in report["steps"]],
    }


def phase_main(args: argparse.Namespace) -> None:
    # The trainer's warnings (each failed microbatch) with their level and time: what a stall
    # prints (`bench.stall.last_errors`).
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    work = Path(args.work)
    job_path = work / f"{args.shape}.toml"
    phase = args.phase
    try:
        if phase.startswith("swarm"):
            out = run_swarm(args, job_path, work, phase == "swarm-compiled")
        else:
            out = run_torch(args, job_path, "compiled" in phase, phase.startswith("pass"))
        out["flops_per_sequence"] = flops_per_sequence(job_path)  # torch is imported here
    except Exception as e:  # an out-of-memory one-pass run is a figure, not a failure
        if "out of memory" not in str(e).lower():
            raise
        out = {"oom": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    print("RESULT " + json.dumps(out), flush=True)


# --- the runs side by side ----------------------------------------------------------------------


def flops_per_sequence(job_path: Path) -> float:
    """A sequence's model FLOPs, said by each run (`summarize` reads it): the process that
    starts the runs imports no torch, a second import of it on each of the check's CPU runs."""
    from swarm.job.config import load_job
    from swarm.model.transformer import layer_costs

    return 3.0 * sum(layer_costs(load_job(job_path).model))  # the backward costs about 2x


def peak_tflops(args: argparse.Namespace) -> float:
    if args.peak_tflops:
        return float(args.peak_tflops)
    if not args.device.startswith("cuda") or args.precision != "bf16-mixed":
        return 0.0
    # asked in a process of its own: this one holds no CUDA context beside the runs'
    ask = "import sys, torch; print(torch.cuda.get_device_name(torch.device(sys.argv[1])))"
    name = subprocess.run(
        [sys.executable, "-c", ask, args.device], capture_output=True, text=True, check=False
    ).stdout.strip()
    return next((peak for known, peak in BF16_PEAK_TFLOPS if known in name), 0.0)


def summarize(r: dict, args: argparse.Namespace, job_path: Path, peak: float) -> dict:
    """A run's figures over its timed steps (those after the warm-up)."""
    from swarm.job.config import load_job

    if "oom" in r or "error" in r or "skipped" in r:
        return r
    job = load_job(job_path)
    timed = r["seconds"][args.warmup :]
    tokens = job.training.target_batch_size * job.model.seq_len
    rate = tokens * len(timed) / sum(timed)
    flops = r["flops_per_sequence"] * job.training.target_batch_size * len(timed) / sum(timed)
    out = {
        **r,
        "tokens_per_s": rate,
        "p50_s": statistics.median(timed),
        "p90_s": statistics.quantiles(timed, n=10)[-1] if len(timed) > 1 else timed[0],
        "model_tflops": flops / 1e12,
        "mfu": flops / (peak * 1e12) if peak else None,
    }
    if "blocked" in r:
        out["commit_share"] = sum(r["blocked"][args.warmup :]) / sum(timed)
    return out


def run_phase(
    args: argparse.Namespace, phase: str, shape: str, work: Path, timeout: float | None = None
) -> dict:
    """One run in a process group of its own (`bench.process_groups`), ended whole, the stage
    servers it started with it, at `timeout`, or once a swarm run commits no step for its
    stall bound (`bench.stall`); then checked to have left nothing behind. A failed run's
    error carries the trainer's last warnings and errors, and each server's last."""
    cmd = [sys.executable, __file__, "--phase", phase, "--shape", shape, "--work", str(work)]
    cmd += ["--device", args.device, "--precision", args.precision]
    cmd += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    cmd += ["--cpu-tiny"] if args.cpu_tiny else []
    cmd += ["--py-spy"] if args.py_spy else []
    cmd += ["--server-faults", args.server_faults] if args.server_faults else []
    log = work / f"{shape}-{phase}.log"
    swarm = phase.startswith("swarm")
    watch = Stall(log, stall_bound(args, phase)) if swarm else None
    before = process_groups.device_memory_mib(args.device)
    mps = mps_daemon(work) if phase == "swarm-mps" else contextlib.nullcontext({})
    with open(log, "w", encoding="utf-8", errors="replace") as f, mps as extra:
        ended = process_groups.run(
            cmd,
            out=f,
            timeout=timeout or PHASE_TIMEOUT_S,
            kind=process_groups.Kind.GROUP,  # in this process's session: a check's part's
            env={**os.environ, **extra},  # MPS's clients: this phase and its servers
            watch=watch,
        )
    settled, line = process_groups.settle(
        ended, before, lambda: process_groups.device_memory_mib(args.device)
    )
    how = ended.why or f"exit {ended.code}"
    print(f"  {shape} {phase}: {how} ({ended.seconds:.0f} s in all); {line}", flush=True)
    output = log.read_text(errors="replace")
    found = [x for x in output.splitlines() if x.startswith("RESULT ")]
    if ended.code or not found or not settled:
        return {"error": failure(how, output, log, server_logs(work, shape, phase)), "why": how}
    return dict(json.loads(found[-1][len("RESULT ") :]))


def stall_bound(args: argparse.Namespace, phase: str) -> float:
    if args.stall_s:
        return float(args.stall_s)
    return STALL_S["smoke" if args.smoke else "compiled" if "compiled" in phase else "eager"]


def failure(how: str, output: str, log: Path, servers: list[Path]) -> str:
    """Why a run failed: how it ended, the trainer's last warnings and errors (or its output's
    tail), and each stage server's last."""
    lines = last_errors(output) or output.strip().splitlines()[-8:]
    text = f"{how}; log {log}; the trainer's last errors:\n" + "\n".join(lines)
    for path in servers:
        last = last_errors(path.read_text(errors="replace"), 1)
        text += f"\n{path.name}: {last[0] if last else 'no warning or error'}"
    return text


def show_server_logs(work: Path, shape: str, phase: str) -> None:
    """The stage servers' INFO logs (the tail of each), as the device check keeps them."""
    for path in server_logs(work, shape, phase):
        lines = path.read_text(errors="replace").splitlines()[-SERVER_LOG_LINES:]
        print(f"--- {path.name} (its last {len(lines)} lines) ---", flush=True)
        print("\n".join(lines), flush=True)


def _cell(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def table(shape: str, rows: dict[str, dict], baseline: dict[str, str | None]) -> str:
    lines = [
        f"### {shape}",
        "| run | tokens/s | ratio | p50 s | p90 s | TFLOP/s | MFU % | busy % | commit % "
        "| evictions | max loss diff vs (a) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        if "tokens_per_s" not in r:
            what = "OOM" if "oom" in r else "not run" if "skipped" in r else "FAILED"
            lines.append(f"| {name} | {what} |" + " |" * 9)
            continue
        ratios = []
        for kind, base in baseline.items():
            if base is not None and name != base:
                ratios.append(f"{r['tokens_per_s'] / rows[base]['tokens_per_s']:.2f}x {kind}")
        mfu = None if r["mfu"] is None else 100 * r["mfu"]
        share = r.get("commit_share")
        evictions = r.get("evictions")
        lines.append(
            f"| {name} | {r['tokens_per_s']:.0f} | {', '.join(ratios) or '-'} | "
            f"{r['p50_s']:.3f} | {r['p90_s']:.3f} | {r['model_tflops']:.2f} | "
            f"{_cell(mfu, '.1f')} | {_cell(r['busy'], '.0f')} | "
            f"{'-' if share is None else f'{100 * share:.0f}'} | "
            f"{'-' if evictions is None else sum(e or 0 for e in evictions)} | "
            f"{_cell(r.get('loss_diff'), '.2e') if 'loss_diff' in r else '-'} |"
        )
    return "\n".join(lines)


def faster(rows: dict[str, dict], prefix: str) -> str | None:
    """The torch run of a kind (`prefix`) with the most tokens/s: the baseline of its ratio."""
    ok = [p for p in rows if p.startswith(prefix) and "tokens_per_s" in rows[p]]
    return max(ok, key=lambda p: rows[p]["tokens_per_s"]) if ok else None


def mps_ab(rows: dict[str, dict]) -> str:
    """The swarm run under MPS against the one without, in this run."""
    a, b = rows["swarm"].get("tokens_per_s"), rows["swarm-mps"].get("tokens_per_s")
    if not a or not b:
        return "a run failed (see its row)"
    return f"swarm {a:.0f} tokens/s without, {b:.0f} with MPS ({b / a:.2f}x)"


def plan(args: argparse.Namespace) -> list[str]:
    """The runs of a shape, in order: swarm first (what is under test, and what a stall stops
    at once), then the torch runs; the compiled ones last, the dearest to start."""
    if args.smoke:
        return ["swarm"]
    compiled = args.compile == "on" or (args.compile == "auto" and args.device.startswith("cuda"))
    phases = ["swarm", "microbatched-eager", "pass-eager"]
    phases += ["microbatched-compiled", "pass-compiled", "swarm-compiled"] if compiled else []
    return phases


def compare(args: argparse.Namespace) -> int:
    process_groups.become_subreaper()  # a run's orphaned servers come here, to be reaped
    work = Path(tempfile.mkdtemp(prefix="swarm-gpu-ratio-"))
    started = time.monotonic()
    phases = plan(args)
    mps = mps_unavailable(args.device) if args.mps else None
    phases += ["swarm-mps"] if args.mps and mps is None else []  # (c) under MPS, for the A/B
    peak = peak_tflops(args)
    report: dict[str, Any] = {"device": args.device, "precision": args.precision, "shapes": {}}
    failures: list[str] = []
    print(
        f"swarm against torch on {args.device}, {args.precision}, {args.warmup} warm-up + "
        f"{args.steps} timed steps; peak {peak or 'unknown'} TFLOP/s; logs in {work}",
        flush=True,
    )
    stalled = ""
    for shape in args.shapes.split(","):
        job_path = work / f"{shape}.toml"
        job_path.write_text(job_text(args, shape))
        rows: dict[str, dict] = {}
        for p in phases:
            left = args.budget_s - (time.monotonic() - started) if args.budget_s else 1e9
            if stalled or left < MIN_PHASE_S:
                why = f"an earlier run {stalled}" if stalled else "--budget-s spent"
                rows[p] = {"skipped": why}
                print(f"  {shape} {p}: not run: {why}", flush=True)
                continue
            try:
                r = run_phase(args, p, shape, work, min(PHASE_TIMEOUT_S, left))
            except MpsUnavailable as e:  # the host would not run the daemon: no A/B, no failure
                mps, phases = f"not available: {e}", [x for x in phases if x != p]
                continue
            cut = left < PHASE_TIMEOUT_S and r.get("why", "").startswith("timed out")
            if cut and not args.smoke:  # a run the budget ended is not a failure (the smoke's is)
                r = {"skipped": f"--budget-s spent while it ran ({r['why']})"}
            rows[p] = summarize(r, args, job_path, peak)
            if args.smoke:
                show_server_logs(work, shape, p)
            if r.get("why", "").startswith("stalled"):
                stalled = r["why"]  # the same servers would stall again: stop here
        failures += [f"{shape} {p}: {r['error']}" for p, r in rows.items() if "error" in r]
        failures += check_losses(args, shape, rows, phases)
        shape_report: dict[str, Any] = {"rows": rows, "baseline": {}}
        if not args.smoke:
            baseline = {"(a)": faster(rows, "microbatched"), "(b)": faster(rows, "pass")}
            print(table(shape, rows, baseline), flush=True)
            for name in (p for p in phases if p.startswith("swarm")):
                said = rows.get(name, {}).get("timeline")
                if said:
                    print(f"{shape} {name}: {said['markdown']}", flush=True)
                    keep(args, Path(said["trace"]))
                    took = rows[name].get("state_download_s")
                    if took is not None:
                        print(
                            f"The trained state's download after the last step: {took:.1f} s "
                            "(outside every step; the busy % leaves it out)",
                            flush=True,
                        )
                for line in rows.get(name, {}).get("py_spy", []):
                    print(line, flush=True)
                    if line.startswith("the stacks: "):
                        keep(args, Path(line.removeprefix("the stacks: ")))
            shape_report = {"rows": rows, "baseline": baseline, **ratios(rows, phases, baseline)}
        if args.mps:
            print(f"MPS A/B: {mps or mps_ab(rows)}", flush=True)
            report["mps"] = mps or mps_ab(rows)
        report["shapes"][shape] = shape_report
    report["failures"] = failures
    for f in failures:
        print(f"FAIL {f}", flush=True)
    print("RESULT " + json.dumps(report), flush=True)
    return 1 if failures else 0


def keep(args: argparse.Namespace, path: Path) -> None:
    """`path` copied into `--out` (where given): what a device run brings back."""
    if args.out and path.exists():
        Path(args.out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(args.out) / path.name)


def check_losses(
    args: argparse.Namespace, shape: str, rows: dict[str, dict], phases: list[str]
) -> list[str]:
    """Each swarm run's losses against (a)'s, step by step; in --smoke (no torch run) every
    step committed with a finite loss."""
    failures = []
    reference = rows.get("microbatched-eager", {}).get("losses")
    tolerance = LOSS_TOLERANCE[args.precision]
    for name in (p for p in phases if p.startswith("swarm")):
        run = rows.get(name, {})
        losses = run.get("losses")
        if args.smoke and "skipped" in run:  # the smoke is both shapes, or it failed
            failures.append(f"{shape} {name}: not run: {run['skipped']}")
        whole = losses is not None and len(losses) == args.warmup + args.steps
        if args.smoke and losses is not None and not (whole and all(map(math.isfinite, losses))):
            failures.append(f"{shape} {name}: losses {losses}: steps missing or not finite")
        if reference and losses:
            pairs = list(zip(losses, reference, strict=False))
            run["loss_diff"] = max(abs(s - t) / abs(t) for s, t in pairs)
            if len(pairs) != len(reference) or run["loss_diff"] > tolerance:
                failures.append(
                    f"{shape} {name}: losses {losses} against (a)'s {reference}: "
                    f"{run['loss_diff']:.2e} > {tolerance} (relative) or steps missing"
                )
    return failures


def ratios(rows: dict[str, dict], phases: list[str], baseline: dict[str, str | None]) -> dict:
    """The faster swarm run's tokens/s over each baseline's: the ratios the targets name."""
    swarm = max(
        (rows[p] for p in phases if p.startswith("swarm") and p in rows),
        key=lambda r: r.get("tokens_per_s", 0.0),
        default={},
    )
    out = {}
    for kind, base in baseline.items():
        if base and "tokens_per_s" in swarm:
            out[f"swarm_over_{kind[1]}"] = swarm["tokens_per_s"] / rows[base]["tokens_per_s"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda:N or cpu (default: cuda:0)")
    parser.add_argument("--shapes", default="long,short", help="of: short, long, in this order")
    parser.add_argument("--warmup", type=int, default=None, help="default 2 (--smoke: 0)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (5; --smoke: 2)")
    parser.add_argument("--precision", choices=tuple(LOSS_TOLERANCE), default=None)
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="the device's dense peak")
    parser.add_argument("--cpu-tiny", action="store_true", help="a tiny model on the CPU (CI)")
    parser.add_argument("--mps", action="store_true", help="(c) again under CUDA MPS: an A/B")
    parser.add_argument(
        "--smoke", action="store_true", help="swarm alone, its servers' INFO logs shown"
    )
    parser.add_argument(
        "--stall-s", type=float, default=0.0, help="no committed step for this long: stop"
    )
    parser.add_argument(
        "--budget-s", type=float, default=0.0, help="start no run past this (0: no limit)"
    )
    parser.add_argument(
        "--server-faults", default="", help="SWARM_FAULTS of the stage servers: [stageK:]p@s,..."
    )
    parser.add_argument(
        "--out", default="", help="a folder for each swarm run's trace (Perfetto's format)"
    )
    parser.add_argument(
        "--py-spy", action="store_true", help="sample the stage servers over the timed steps"
    )
    parser.add_argument("--phase", help=argparse.SUPPRESS)  # one run, in its own process
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.device = args.device or ("cpu" if args.cpu_tiny else "cuda:0")
    if args.precision is None:  # what a GPU trains in, on a CPU too (--cpu-tiny)
        cuda = args.device.startswith("cuda")
        args.precision = "bf16-mixed" if cuda or args.cpu_tiny else "fp32"
    if args.warmup is None:
        args.warmup = 0 if args.smoke else 2
    if args.steps is None:
        args.steps = 2 if args.smoke else 5
    if args.phase:
        phase_main(args)
        return 0
    if any(s not in SHAPES for s in args.shapes.split(",")) or args.steps < 1:
        parser.error(f"--shapes: a comma-separated list of {', '.join(SHAPES)}; --steps >= 1")
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
