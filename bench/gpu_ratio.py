"""Swarm against single-process torch on the same device, in one run (issue 53): part of
bench/gpu_check.sh.

    python bench/gpu_ratio.py [--device cuda:0] [--shapes short,long] [--warmup 2] [--steps 5]
        [--precision bf16-mixed] [--compile auto|on|off] [--peak-tflops T] [--cpu-tiny] [--mps]

The model is examples/llama-1b.toml's. Each run is its own process, one after the other on the
one device, warm-up steps and then timed steps:
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
every step's loss against (a)'s (within 1% in bf16-mixed, 1e-4 in fp32). A one-pass run the
device has no memory for is reported (OOM), not failed. The last line is `RESULT {json}`; exit
status 1 when a run failed or a loss disagreed.

`--cpu-tiny`: a few layers of width 64 on the CPU, in fp32 (CI runs it as the device check's part:
tests/system/test_gpu_check.py).
`--mps`: (c) once more with NVIDIA's MPS daemon running (bench/mps.py), its tokens/s against (c)'s
in the same run; where the host cannot run it, "MPS A/B: not available" and why.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
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

from bench import forked_servers  # noqa: E402
from bench.gpu_check import BF16_PEAK_TFLOPS  # noqa: E402
from bench.llama_1b import JOB, TINY, set_keys  # noqa: E402
from bench.mps import MpsUnavailable, mps_daemon, mps_unavailable  # noqa: E402

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

    def start(self) -> None:
        if self._handle is not None:
            self._thread.start()

    def stop(self) -> float | None:
        if self._handle is None:
            return None
        self._done.set()
        self._thread.join()
        return statistics.fmean(self.samples) if self.samples else None


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


def run_swarm(args: argparse.Namespace, job_path: Path, work: Path, compiled: bool) -> dict:
    """(c): one stage server per stage on the device, the standalone trainer in this process."""
    from client.standalone import train_standalone
    from swarm.device.facts import read_evictions
    from swarm.job.config import load_job
    from swarm.local.procs import SwarmProcess, start_process, stop_all
    from swarm.ops.progress import StepRecord
    from swarm.rpc.lease import Replica

    job = load_job(job_path)
    servers: list[SwarmProcess] = []
    records: list[StepRecord] = []
    busy = Busy(args.device)

    def on_step(record: StepRecord) -> None:
        records.append(record)
        if len(records) == args.warmup:
            busy.start()

    try:
        for k in range(job.training.stages):
            cmd = ["stage-server", "--job", str(job_path), "--stage", str(k), "--port", "0"]
            cmd += ["--device", args.device] + (["--threads", "1"] if args.cpu_tiny else [])
            cmd += ["--compile-stage"] if compiled else []
            servers.append(start_process(cmd, log_dir=work, name=f"stage-{k}"))
        for s in servers:
            s.wait_ready(PHASE_TIMEOUT_S)
        pool = [[Replica(s.address, s.address)] for s in servers]
        asyncio.run(train_standalone(job, pool, on_step=on_step))
        used = busy.stop()
    finally:
        stop_all(servers)  # SIGTERM to each before waiting for any: their shutdowns overlap
    evictions = [read_evictions(s.log()) for s in servers]
    return {
        "losses": [r.loss for r in records],
        "seconds": [r.seconds for r in records],
        "blocked": [r.blocked_seconds for r in records],
        "busy": used,
        "evictions": evictions,
    }


def phase_main(args: argparse.Namespace) -> None:
    work = Path(args.work)
    job_path = work / f"{args.shape}.toml"
    phase = args.phase
    try:
        if phase.startswith("swarm"):
            out = run_swarm(args, job_path, work, phase == "swarm-compiled")
        else:
            out = run_torch(args, job_path, "compiled" in phase, phase.startswith("pass"))
    except Exception as e:  # an out-of-memory one-pass run is a figure, not a failure
        if "out of memory" not in str(e).lower():
            raise
        out = {"oom": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    print("RESULT " + json.dumps(out), flush=True)


# --- the runs side by side ----------------------------------------------------------------------


def flops_per_sequence(job_path: Path) -> float:
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

    if "oom" in r or "error" in r:
        return r
    job = load_job(job_path)
    timed = r["seconds"][args.warmup :]
    tokens = job.training.target_batch_size * job.model.seq_len
    rate = tokens * len(timed) / sum(timed)
    flops = flops_per_sequence(job_path) * job.training.target_batch_size * len(timed) / sum(timed)
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


def run_phase(args: argparse.Namespace, phase: str, shape: str, work: Path) -> dict:
    cmd = [sys.executable, __file__, "--phase", phase, "--shape", shape, "--work", str(work)]
    cmd += ["--device", args.device, "--precision", args.precision]
    cmd += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    cmd += ["--cpu-tiny"] if args.cpu_tiny else []
    log = work / f"{shape}-{phase}.log"
    mps = mps_daemon(work) if phase == "swarm-mps" else contextlib.nullcontext({})
    with open(log, "w+", encoding="utf-8", errors="replace") as f, mps as extra:
        try:
            code = subprocess.run(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=PHASE_TIMEOUT_S,
                check=False,
                env={**os.environ, **extra},  # MPS's clients: this phase and its servers
            ).returncode
        except subprocess.TimeoutExpired:
            code = -9
        f.seek(0)
        output = f.read()
    found = [x for x in output.splitlines() if x.startswith("RESULT ")]
    if code or not found:
        tail = "\n".join(output.strip().splitlines()[-8:])
        return {"error": f"exit {code}; log {log}:\n{tail}"}
    return dict(json.loads(found[-1][len("RESULT ") :]))


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
            lines.append(f"| {name} | {'OOM' if 'oom' in r else 'FAILED'} |" + " |" * 9)
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


def compare(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="swarm-gpu-ratio-"))
    compiled = args.compile == "on" or (args.compile == "auto" and args.device.startswith("cuda"))
    kinds = ["eager", "compiled"] if compiled else ["eager"]
    phases = [f"{how}-{k}" for how in ("microbatched", "pass") for k in kinds] + ["swarm"]
    phases += ["swarm-compiled"] if compiled else []  # the stage servers' --compile-stage
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
    for shape in args.shapes.split(","):
        job_path = work / f"{shape}.toml"
        job_path.write_text(job_text(args, shape))
        rows = {}
        for p in phases:
            try:
                rows[p] = summarize(run_phase(args, p, shape, work), args, job_path, peak)
            except MpsUnavailable as e:  # the host would not run the daemon: no A/B, no failure
                mps, phases = f"not available: {e}", [x for x in phases if x != p]
        failures += [f"{shape} {p}: {r['error']}" for p, r in rows.items() if "error" in r]
        reference = rows["microbatched-eager"].get("losses")
        tolerance = LOSS_TOLERANCE[args.precision]
        for name in (p for p in phases if p.startswith("swarm")):
            run = rows[name]
            if reference and run.get("losses"):
                pairs = list(zip(run["losses"], reference, strict=False))
                run["loss_diff"] = max(abs(s - t) / abs(t) for s, t in pairs)
                if len(pairs) != len(reference) or run["loss_diff"] > tolerance:
                    failures.append(
                        f"{shape} {name}: losses {run['losses']} against (a)'s {reference}: "
                        f"{run['loss_diff']:.2e} > {tolerance} (relative) or steps missing"
                    )
        swarm = max(
            (rows[p] for p in phases if p.startswith("swarm")),
            key=lambda r: r.get("tokens_per_s", 0.0),
        )  # the faster swarm run: the ratios the targets name

        baseline = {"(a)": faster(rows, "microbatched"), "(b)": faster(rows, "pass")}
        print(table(shape, rows, baseline), flush=True)
        if args.mps:
            print(f"MPS A/B: {mps or mps_ab(rows)}", flush=True)
            report["mps"] = mps or mps_ab(rows)
        report["shapes"][shape] = {"rows": rows, "baseline": baseline}
        for kind, base in baseline.items():
            if base and "tokens_per_s" in swarm:
                ratio = swarm["tokens_per_s"] / rows[base]["tokens_per_s"]
                report["shapes"][shape][f"swarm_over_{kind[1]}"] = ratio
    report["failures"] = failures
    for f in failures:
        print(f"FAIL {f}", flush=True)
    print("RESULT " + json.dumps(report), flush=True)
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda:N or cpu (default: cuda:0)")
    parser.add_argument("--shapes", default="short,long", help="of: short, long")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up")
    parser.add_argument("--precision", choices=tuple(LOSS_TOLERANCE), default=None)
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="the device's dense peak")
    parser.add_argument("--cpu-tiny", action="store_true", help="a tiny model on the CPU (CI)")
    parser.add_argument("--mps", action="store_true", help="(c) again under CUDA MPS: an A/B")
    parser.add_argument("--phase", help=argparse.SUPPRESS)  # one run, in its own process
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    forked_servers.use_if_asked()
    args.device = args.device or ("cpu" if args.cpu_tiny else "cuda:0")
    if args.precision is None:
        args.precision = "bf16-mixed" if args.device.startswith("cuda") else "fp32"
    if args.phase:
        phase_main(args)
        return 0
    if any(s not in SHAPES for s in args.shapes.split(",")) or args.steps < 1:
        parser.error(f"--shapes: a comma-separated list of {', '.join(SHAPES)}; --steps >= 1")
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
