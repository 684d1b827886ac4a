"""A 1B-parameter Llama (examples/llama-1b.toml) trained by 4 stage servers, one replica a stage:
does it fit, and what each server's peak RSS is against the state it holds.

    .venv/bin/python bench/llama_1b.py [--steps 3] [--device cuda:0] [--peak-tflops 989] [--json]
        [--precision bf16-mixed] [--microbatch-size 4 --batch 16] [--checkpoint-every 0] [--tiny]

Starts the 4 stage servers (`swarm stage-server --job J --stage k`, the standalone path, one
torch thread each on a CPU), trains `--steps` steps with the standalone trainer in this process,
which writes the job's checkpoints (`checkpoint_every`, under `--dir`), and prints per server its
parameters, state (16 B a parameter: float32 weights, gradient sums, AdamW's two moments), peak
RSS (VmHWM) and their ratio, the trainer's largest RSS while it trained (checkpoints included),
the checkpoints written, and the run's tokens/s and model FLOP/s (6 x parameters x tokens; MFU
against `--peak-tflops`, the device's dense peak, when given). On CUDA each server's device
memory too: its `max_memory_allocated`, which a stage server logs as it stops (the state lives
on the GPU; the host RSS is then the process's, not the model's). `--tiny` shrinks the model to
a few layers of width 64, so that CI runs this on a CPU (bench/gpu_check.sh --quick).
While it runs it watches the machine's MemAvailable: below `--min-free-gib` it stops every
server and says so (a size that does not fit ends as a report, not as the OOM killer's pick).
"""

from __future__ import annotations

import _thread
import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import forked_servers  # noqa: E402
from bench.bulk import GiB, peak_rss  # noqa: E402
from bench.gpu_train_check import device_peak  # noqa: E402
from bench.llama_job import JOB, TINY, set_keys  # noqa: E402
from client.standalone import train_standalone  # noqa: E402
from swarm.job.config import load_job  # noqa: E402
from swarm.local.procs import SwarmProcess, start_process, stop_all  # noqa: E402
from swarm.model import checkpoint  # noqa: E402
from swarm.model.transformer import stage_layout  # noqa: E402
from swarm.ops.progress import StepRecord  # noqa: E402
from swarm.rpc.lease import Replica  # noqa: E402

READY_TIMEOUT_S = 900.0


def own_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


class Watch:
    """MemAvailable every 0.2 s: its lowest, and the servers stopped when it falls too low; and
    this process's largest RSS until `training` is cleared (the trainer's, with its checkpoint
    writes, not the trained model it downloads at the end)."""

    def __init__(self, servers: list[SwarmProcess], floor: int) -> None:
        self.servers, self.floor, self.lowest, self.tripped = servers, floor, available(), False
        self.training, self.trainer_rss = True, own_rss()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(0.2):
            free = available()
            self.lowest = min(self.lowest, free)
            if self.training:
                self.trainer_rss = max(self.trainer_rss, own_rss())
            if free < self.floor and not self.tripped:
                self.tripped = True
                for s in self.servers:
                    s.kill()
                _thread.interrupt_main()  # the trainer would wait for them to come back

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="the stage servers' device, e.g. cuda:0")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="for MFU (dense peak)")
    parser.add_argument("--min-free-gib", type=float, default=1.0)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (a temp directory)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16-mixed"),
        default=None,
        help="training.precision (default: the example's, fp32)",
    )
    parser.add_argument("--microbatch-size", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None, help="training.target_batch_size")
    parser.add_argument("--checkpoint-every", type=int, default=None, help="0: no checkpoints")
    parser.add_argument("--tiny", action="store_true", help="a small model of the same kind")
    args = parser.parse_args()
    forked_servers.use_if_asked()
    work = Path(tempfile.mkdtemp(prefix="swarm-llama-1b-", dir=args.dir))
    ckpt = work / "checkpoints"
    text = JOB.read_text().replace(
        'path = "data/corpus.txt"', f'path = "{JOB.parent}/data/corpus.txt"'
    )
    text = text.replace("steps = 3\n", f"steps = {args.steps}\n")
    text = _override(text, args)
    job_path = work / "llama-1b.toml"
    job_path.write_text(text)
    job = load_job(job_path)
    stages = job.training.stages
    params = [sum(p.numel() for p in stage_layout(job, k).parameters()) for k in range(stages)]
    servers: list[SwarmProcess] = []
    records: list[StepRecord] = []
    watch: Watch | None = None
    started = time.perf_counter()
    try:
        for k in range(stages):
            cmd = ["stage-server", "--job", str(job_path), "--stage", str(k), "--port", "0"]
            cmd += ["--device", args.device] + (["--threads", "1"] if args.device == "cpu" else [])
            servers.append(start_process(cmd, log_dir=work, name=f"stage-{k}"))
        watch = Watch(servers, int(args.min_free_gib * GiB))
        for s in servers:
            s.wait_ready(READY_TIMEOUT_S)
        ready = time.perf_counter()
        pool = [[Replica(s.address, s.address)] for s in servers]
        last = job.training.steps - 1

        def on_step(record: StepRecord) -> None:
            records.append(record)
            if record.step == last and watch is not None:
                watch.training = False  # the trained model's download comes next

        asyncio.run(train_standalone(job, pool, on_step=on_step, checkpoint_dir=ckpt))
        trained = time.perf_counter()
        peaks = [peak_rss(s.proc.pid) for s in servers]
    except BaseException:
        if watch is not None and watch.tripped:
            print(f"stopped: MemAvailable fell below {args.min_free_gib} GiB", file=sys.stderr)
        print(f"logs in {work}", file=sys.stderr)
        raise
    finally:
        if watch is not None:
            watch.stop()
        stop_all(servers)  # SIGTERM to each before waiting for any: their shutdowns overlap
    device_peaks = [device_peak(s) for s in servers]  # logged as each stopped; None off CUDA
    written = checkpoint.sealed(ckpt)
    files = sorted(ckpt.glob("step-*/stage-*"))
    tokens = sum(r.tokens for r in records[1:])  # the first step warms up
    seconds = sum(r.seconds for r in records[1:])
    flops = 6 * sum(params) * tokens / seconds if seconds > 0 else 0.0
    out: dict[str, Any] = {
        "params": params,
        "peak_rss": peaks,
        "device_peak": device_peaks,
        "lowest_available": watch.lowest if watch else 0,
        "trainer_rss": watch.trainer_rss if watch else 0,
        "checkpoints": written,
        "checkpoint_bytes": sum(f.stat().st_size for f in files),
        "start_seconds": ready - started,
        "train_seconds": trained - ready,
        "losses": [r.loss for r in records],
        "step_seconds": [r.seconds for r in records],
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "model_tflops": flops / 1e12,
        "mfu": flops / (args.peak_tflops * 1e12) if args.peak_tflops else None,
        "precision": job.training.precision,
        "batch": [job.training.microbatch_size, job.training.target_batch_size],
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(
        f"{sum(params) / 1e9:.2f}B parameters in {stages} stages on {args.device}; "
        f"servers ready in {out['start_seconds']:.0f} s, {len(records)} steps in "
        f"{out['train_seconds']:.0f} s"
    )
    print()
    print("| stage | parameters | state GB | peak RSS GiB | peak/state | device peak GiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for k, (n, peak) in enumerate(zip(params, peaks, strict=True)):
        dev = device_peaks[k]
        print(
            f"| {k} | {n / 1e6:.0f}M | {16 * n / 1e9:.2f} | {peak / GiB:.2f} | "
            f"{(dev or peak) / (16 * n):.2f} | {'-' if dev is None else f'{dev / GiB:.2f}'} |"
        )
    print(
        f"\nall servers: {sum(peaks) / GiB:.2f} GiB at their peaks; the machine's lowest "
        f"MemAvailable {out['lowest_available'] / GiB:.2f} GiB; the trainer (this process, "
        f"writing the checkpoints) at most {out['trainer_rss'] / GiB:.2f} GiB while it trained"
    )
    print(
        f"checkpoints sealed at steps {written} ({out['checkpoint_bytes'] / 1e9:.2f} GB in "
        f"{len(files)} stage files)"
    )
    print(
        f"losses {[round(x, 3) for x in out['losses']]}; step seconds "
        f"{[round(x, 1) for x in out['step_seconds']]}; {out['tokens_per_s']:.1f} tokens/s, "
        f"{out['model_tflops']:.3f} model TFLOP/s"
        + (f", MFU {out['mfu']:.3f}" if out["mfu"] else "")
    )


def _override(text: str, args: argparse.Namespace) -> str:
    """The example's job text with the flags' keys in place of its own."""
    keys: dict[str, object] = dict(TINY) if args.tiny else {}
    if args.precision:
        keys["precision"] = f'"{args.precision}"'
    for key, value in (
        ("microbatch_size", args.microbatch_size),
        ("target_batch_size", args.batch),
        ("checkpoint_every", args.checkpoint_every),
    ):
        if value is not None:
            keys[key] = value
    return set_keys(text, keys)


if __name__ == "__main__":
    main()
