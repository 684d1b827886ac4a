"""The price of each codec between stages, or in a pool's averaging: bytes and the loss it costs.

    .venv/bin/python bench/compression.py [--steps 300] [--codecs none,fp16,...] [--json]
        [--averaging]

For every codec, the tiny text job (examples/tiny.toml: a 4-block byte-level GPT on the bundled
corpus, 4 stages, float32) trains `--steps` steps on 4 stage servers (one process each, on
localhost) with `[compression] wire = codec`, so activations and their gradients both travel
compressed. Printed per codec: the bytes that crossed the stage boundaries per microbatch, both
ways, as encoded (read from the stage servers' `swarm_stage_boundary_bytes_sent_total`: each
boundary tensor is counted once, by the server that sends it, on either data plane), that figure
against `none` (float32), and the final loss (the mean of the last 20 steps' training losses)
against `none`'s, all measured in this run.

With `--averaging` every stage has two replicas (8 processes) and the codec is `[compression]
averaging` (the wire stays float32): printed per codec, the gradient bytes each replica sends its
pool per step (`swarm_stage_averaging_bytes_sent_total`) and the final loss, against the
synchronous float32 run. The lossy codecs run with `[compression] error_feedback` (the default)
and again without it (`<codec>+no_feedback`), and one more row trains with
`training.delayed_update` (float32 averaging), whose loss is the price of one step of staleness.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from client.standalone import train_standalone  # noqa: E402
from swarm.job.config import load_job  # noqa: E402
from swarm.local.procs import start_stage_servers, stop_all  # noqa: E402
from swarm.ops.progress import StepRecord  # noqa: E402
from swarm.rpc.lease import Replica  # noqa: E402

CODECS = ("none", "fp16", "bf16", "int8_blockwise", "hadamard3")
LAST = 20  # the final loss is the mean over this many last steps (one step's loss is noisy)
_WIRE = re.compile(r"^swarm_stage_boundary_bytes_(sent)_total\{[^}]*\} (\S+)$", re.M)
_AVERAGING = re.compile(r"^swarm_stage_averaging_bytes_(sent)_total\{[^}]*\} (\S+)$", re.M)
DELAYED = "none+delayed_update"  # the --averaging row that trains with one step of staleness
NO_FEEDBACK = "+no_feedback"  # an --averaging row of a lossy codec without error feedback


def job_text(codec: str, steps: int, averaging: bool = False) -> str:
    tiny = (ROOT / "examples" / "tiny.toml").read_text()
    tiny = tiny.replace('path = "data/corpus.txt"', f'path = "{ROOT / "examples/data/corpus.txt"}"')
    tiny = re.sub(r"^steps = \d+$", f"steps = {steps}", tiny, flags=re.M)
    if not averaging:
        return re.sub(r'^wire = "none"$', f'wire = "{codec}"', tiny, flags=re.M)
    delayed = codec == DELAYED
    tiny = re.sub(
        r"^steps = (\d+)$",
        rf"steps = \1\ndelayed_update = {str(delayed).lower()}",
        tiny,
        flags=re.M,
    )
    averaged = "none" if delayed else codec.removesuffix(NO_FEEDBACK)
    feedback = str(not codec.endswith(NO_FEEDBACK)).lower()
    averaged = f'averaging = "{averaged}"\nerror_feedback = {feedback}'
    return re.sub(r'^wire = "none"$', f'wire = "none"\n{averaged}', tiny, flags=re.M)


def counted(metrics_port: str, counter: re.Pattern[str]) -> float:
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(float(value) for _, value in counter.findall(text))


def run_codec(codec: str, steps: int, work: Path, averaging: bool = False) -> dict[str, float]:
    job_path = work / f"{codec}.toml"
    job_path.write_text(job_text(codec, steps, averaging))
    job = load_job(job_path)
    copies = 2 if averaging else 1  # replicas per stage
    servers = [
        server
        for _ in range(copies)
        for server in start_stage_servers(job_path, job.training.stages, log_dir=work)
    ]
    records: list[StepRecord] = []
    try:
        stages = job.training.stages
        replicas = [
            [Replica(s.address, s.address) for s in servers[k::stages]] for k in range(stages)
        ]
        started = time.perf_counter()
        asyncio.run(train_standalone(job, replicas, on_step=records.append))
        seconds = time.perf_counter() - started
        counter = _AVERAGING if averaging else _WIRE
        sent = sum(counted(s.ready["metrics"], counter) for s in servers)
    finally:
        stop_all(servers)
    microbatches = steps * job.training.microbatches_per_step
    losses = [r.loss for r in records[-LAST:] if r.loss is not None]
    return {
        # --averaging: per replica and step, else per microbatch
        "bytes_per_microbatch": sent / (len(servers) * steps if averaging else microbatches),
        "final_loss": sum(losses) / len(losses),
        "first_loss": float(records[0].loss or 0.0),
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--codecs", default=",".join(CODECS), help="comma-separated; none first")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--averaging",
        action="store_true",
        help="two replicas per stage; the codec is [compression] averaging's",
    )
    args = parser.parse_args()
    codecs = [c for c in args.codecs.split(",") if c]
    if codecs[0] != "none":
        codecs.insert(0, "none")  # the baseline every ratio is against, in this run
    if args.averaging:
        lossy = ("int8_blockwise", "hadamard3")
        codecs += [c + NO_FEEDBACK for c in codecs if c in lossy and c + NO_FEEDBACK not in codecs]
        codecs += [DELAYED] if DELAYED not in codecs else []
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="swarm-compression-") as tmp:
        for codec in codecs:
            results[codec] = run_codec(codec, args.steps, Path(tmp), args.averaging)
            if not args.json:
                print(f"{codec}: {results[codec]}", file=sys.stderr, flush=True)
    base = results["none"]
    for r in results.values():
        r["bytes_vs_none"] = r["bytes_per_microbatch"] / base["bytes_per_microbatch"]
        r["loss_vs_none"] = r["final_loss"] / base["final_loss"]
    if args.json:
        print(json.dumps({"steps": args.steps, "codecs": results}, indent=2))
        return
    print(f"tiny text job, {args.steps} steps; final loss: mean of the last {LAST} steps")
    if args.averaging:
        print("two replicas per stage; bytes: what each replica sends its pool per step")
    unit = "bytes/replica/step" if args.averaging else "bytes/microbatch"
    print(f"| codec | {unit} | x fewer than none | final loss | vs none |")
    print("|---|---|---|---|---|")
    for codec, r in results.items():
        print(
            f"| {codec} | {r['bytes_per_microbatch'] / 1e3:.1f} kB | "
            f"{1 / r['bytes_vs_none']:.1f} | {r['final_loss']:.4f} | "
            f"{100 * (r['loss_vs_none'] - 1):+.2f}% |"
        )


if __name__ == "__main__":
    main()
