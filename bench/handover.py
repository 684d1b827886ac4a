"""The handover between co-located stage servers (issue 53, item 2) against the wire, in one
run: 4 stage servers on this host, either handing boundary tensors over through shared
memory, or with `SWARM_HANDOVER=off` (every hop as gRPC bytes), the same job trained on each
in turn, alternating, so a load that comes and goes weighs on both alike (each run on a fresh
set: a set that trained the job to its end has nothing left to train). Prints samples/s of
each run, the servers' handover counters, and the ratio of the medians.

    .venv/bin/python bench/handover.py [--rounds N] [--steps N]

The job is shaped for the hop, not the compute: a narrow model (d_model 64) over many tokens a
microbatch (64 x 256), so a hop moves 4 MiB of float32 activations, and back their gradient.
On a CPU the handover saves the hop's copies (protobuf, gRPC framing, loopback, reassembly);
the stages' compute is the same either way. On a GPU (`--device cuda`) the handover is CUDA
IPC and saves the hop's trips through host memory as well."""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.pipeline_overhead import train_on  # noqa: E402
from swarm.local.procs import SwarmProcess, start_stage_servers, stop_all  # noqa: E402

JOB = """name = "handover"
[model]
kind = "gpt"
vocab_size = 256
d_model = 64
n_layers = 4
n_heads = 4
seq_len = 256
[data]
kind = "synthetic"
[training]
stages = 4
microbatch_size = 64
target_batch_size = 256
steps = {steps}
dtype = "float32"
[optimizer]
kind = "adamw"
lr = 1e-3
[runtime]
data_plane = "push"
max_in_flight = 4
"""


def handed(servers: list[SwarmProcess]) -> int:
    """Tensors the servers took through the handover (`swarm_stage_handovers_total`)."""
    total = 0.0
    for s in servers:
        with urllib.request.urlopen(f"http://{_metrics(s)}/metrics", timeout=10) as r:
            text = r.read().decode()
        total += sum(
            float(m)
            for m in re.findall(
                r'^swarm_stage_handovers_total\{.*way="taken".*\} (\S+)$', text, re.M
            )
        )
    return int(total)


def _metrics(s: SwarmProcess) -> str:
    return f"127.0.0.1:{s.ready['metrics']}"


def servers(job: Path, work: Path, device: str, handover: bool) -> list[SwarmProcess]:
    cores = os.cpu_count() or 1
    old = os.environ.get("SWARM_HANDOVER")
    os.environ["SWARM_HANDOVER"] = "on" if handover else "off"
    try:
        return start_stage_servers(job, 4, log_dir=work, device=device, threads=max(1, cores // 4))
    finally:
        if old is None:
            del os.environ["SWARM_HANDOVER"]
        else:
            os.environ["SWARM_HANDOVER"] = old


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, alternating")
    parser.add_argument("--steps", type=int, default=4, help="steps a run (first is warm-up)")
    parser.add_argument("--device", default="cpu", help="the stage servers' device")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="swarm-bench-") as tmp:
        work = Path(tmp)
        job = work / "handover.toml"
        job.write_text(JOB.format(steps=args.steps))
        rates: dict[str, list[float]] = {"handover": [], "wire": []}
        taken = {"handover": 0, "wire": 0}
        for r in range(args.rounds):
            for name in ("handover", "wire")[:: 1 if r % 2 == 0 else -1]:
                on = servers(job, work, args.device, handover=name == "handover")
                try:
                    rates[name].append(train_on(job, on, work / f"{name}-{r}.jsonl"))
                    taken[name] += handed(on)
                finally:
                    stop_all(on)
                print(f"round {r} {name:<9} {rates[name][-1]:8.1f} samples/s", flush=True)
    a, b = statistics.median(rates["handover"]), statistics.median(rates["wire"])
    print(f"tensors taken through the handover: {taken['handover']} (on), {taken['wire']} (off)")
    print(f"median samples/s: handover {a:.1f}, wire {b:.1f}; handover/wire {a / b:.3f}")


if __name__ == "__main__":
    main()
