"""2 stages x 2 replicas, each stage server its own process on `--device`, trained against the
CPU reference (`swarm local`'s `train_local`): part of bench/gpu_check.sh.

    python bench/gpu_train_check.py --device cuda:0 --precision fp32 [--steps 20] [--quick]

fp32: every step's loss within 1e-5 (relative) of the reference's, and every trained parameter
tensor within 1e-5 (||swarm - reference|| / ||reference||). bf16-mixed: every step's loss within
1% (bfloat16 rounding, and bf16 on the wire). In both, the replicas of each stage hold bitwise
the same parameters and optimizer state at the end: every replica applies the same averaged
update with the same kernel (swarm/model/optim.py claims it; this checks it on the device).
The job audits at its default `[trust] audit_fraction` (issue 55; `--quick`: every microbatch,
and a run in which no audit agreed fails): an audit that finds two
honest replicas apart past the tolerance of the job's compute (`undecided` with two replicas a
stage; `caught` would be a false accusation) fails the check, and the largest difference an
audit accepted is printed.
Prints the run's tokens/s (steps after the first) and each server's memory: on CUDA its
`max_memory_allocated`, which a stage server logs as it stops; on a CPU its peak RSS. The last
line is `RESULT {json}`; exit status 1 when a tolerance is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from bench import forked_servers  # noqa: E402
from bench.bulk import peak_rss  # noqa: E402
from client.standalone import train_standalone  # noqa: E402
from swarm.device.facts import read_peak  # noqa: E402
from swarm.job.config import load_job  # noqa: E402
from swarm.job.fingerprint import fingerprint  # noqa: E402
from swarm.job.schema import JobConfig  # noqa: E402
from swarm.local.procs import SwarmProcess, start_process, stop_all  # noqa: E402
from swarm.model.reference import train_local  # noqa: E402
from swarm.model.state_checks import StateChecks  # noqa: E402
from swarm.ops.progress import StepRecord  # noqa: E402
from swarm.rpc.lease import Replica  # noqa: E402
from swarm.rpc.stage_client import StageClient  # noqa: E402

STAGES, REPLICAS = 2, 2
TOLERANCE = {"fp32": 1e-5, "bf16-mixed": 1e-2}  # relative, on every step's loss
PARAM_TOLERANCE = 1e-5  # fp32: relative, on every trained tensor
# A llama (what GPU users train) big enough that a GPU's kernels differ from a CPU's.
FULL = {"d_model": 128, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "seq_len": 128}
QUICK = {"d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "seq_len": 16}

JOB = """name = "gpu-check-{precision}"
[model]
kind = "llama"
vocab_size = 256
d_model = {d_model}
n_layers = {n_layers}
n_heads = {n_heads}
n_kv_heads = {n_kv_heads}
seq_len = {seq_len}
[data]
kind = "synthetic"
[training]
stages = {stages}
microbatch_size = {microbatch}
target_batch_size = {batch}
steps = {steps}
seed = 0
dtype = "float32"
precision = "{precision}"
grad_clip = 1.0
checkpoint_every = 0
[optimizer]
kind = "adamw"
lr = 1e-3
weight_decay = 0.01
{trust}"""
# --quick audits every microbatch, so the audits' claim below is checked on every run: at the
# default fraction a short run audits nothing about a quarter of the time, and "agreed" then
# says nothing (issue 65).
QUICK_TRUST = "[trust]\naudit_fraction = 1.0\n"


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def tensor_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def device_peak(server: SwarmProcess) -> int | None:
    """The peak device bytes a stopped stage server logged (None off CUDA)."""
    return read_peak(server.log())


def audits(registry: CollectorRegistry) -> tuple[dict[str, int], float]:
    """The trainer's audits by outcome, and the largest difference between two honest answers
    one accepted (`client.metrics`)."""
    outcomes: dict[str, int] = {}
    largest = 0.0
    for metric in registry.collect():
        for s in metric.samples:
            if s.name == "swarm_trainer_audits_total":
                outcomes[s.labels["outcome"]] = int(s.value)
            elif s.name == "swarm_trainer_audit_max_difference":
                largest = max(largest, s.value)
    return outcomes, largest


async def replica_state(job: JobConfig, stage: int, replica: Replica) -> dict[str, torch.Tensor]:
    """One replica's whole state (parameters and optimizer state), as a joiner downloads it."""
    client = StageClient(replica.address, job, fingerprint(job), stage)
    try:
        _, state = await client.download_state(
            include_optimizer=True, prefix="", expect=StateChecks(job, stage)
        )
        return state
    finally:
        await client.close()


async def replicas_apart(job: JobConfig, pool: list[list[Replica]]) -> list[str]:
    """Per stage, each tensor in which a replica is not bitwise its stage's first replica."""
    apart = []
    for stage, replicas in enumerate(pool):
        states = [await replica_state(job, stage, r) for r in replicas]
        first = states[0]
        for replica, state in zip(replicas[1:], states[1:], strict=True):
            if state.keys() != first.keys():
                apart.append(f"stage {stage}: {replica.peer} holds other tensors than the first")
                continue
            apart += [
                f"stage {stage}: {replica.peer}'s {name} is not bitwise its first replica's"
                for name, tensor in state.items()
                if not torch.equal(tensor, first[name])
            ]
    return apart


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", choices=sorted(TOLERANCE), default="fp32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a tiny model (CI on a CPU)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the training")
    args = parser.parse_args()
    forked_servers.use_if_asked()
    work = Path(tempfile.mkdtemp(prefix=f"swarm-gpu-train-{args.precision}-"))
    shape = QUICK if args.quick else FULL
    microbatch, batch = (2, 8) if args.quick else (8, 32)
    job_path = work / "job.toml"
    job_path.write_text(
        JOB.format(
            precision=args.precision,
            stages=STAGES,
            steps=args.steps,
            microbatch=microbatch,
            batch=batch,
            trust=QUICK_TRUST if args.quick else "",
            **shape,
        )
    )
    job = load_job(job_path)

    servers: list[SwarmProcess] = []
    records: list[StepRecord] = []
    registry = CollectorRegistry()
    reference: list[StepRecord] = []
    threads = ["--threads", "1"] if args.device == "cpu" else []
    try:
        for k in range(STAGES):
            for r in range(REPLICAS):
                cmd = ["stage-server", "--job", str(job_path), "--stage", str(k), "--port", "0"]
                cmd += ["--device", args.device, *threads]
                servers.append(start_process(cmd, log_dir=work, name=f"s{k}r{r}"))
        # The reference trains while the servers start.
        started = time.perf_counter()
        want = train_local(job, "cpu", on_step=reference.append).state_dict()
        reference_s = time.perf_counter() - started
        for s in servers:
            s.wait_ready(180)
        pool = [
            [Replica(f"s{k}r{r}", servers[k * REPLICAS + r].address) for r in range(REPLICAS)]
            for k in range(STAGES)
        ]
        state = asyncio.run(
            asyncio.wait_for(
                train_standalone(job, pool, registry=registry, on_step=records.append),
                args.timeout,
            )
        )
        apart = asyncio.run(replicas_apart(job, pool))
        rss = [peak_rss(s.proc.pid) for s in servers]
    except BaseException:
        print(f"logs in {work}", file=sys.stderr)
        for s in servers:
            print(f"--- {s.log_path.name}\n{s.log()[-1500:]}", file=sys.stderr)
        raise
    finally:
        stop_all(servers)
    peaks = [device_peak(s) for s in servers]

    tol = TOLERANCE[args.precision]
    losses = [r.loss for r in sorted(records, key=lambda r: r.step) if r.samples]
    ref_losses = [r.loss for r in reference if r.samples]
    loss_err = max(rel(a, b) for a, b in zip(losses, ref_losses, strict=True))
    param_errs = {name: tensor_rel(state[name], value) for name, value in want.items()}
    worst = max(param_errs, key=param_errs.__getitem__)
    param_err = param_errs[worst]
    later = [r for r in records if r.step > 0]
    seconds = sum(r.seconds for r in later)
    tokens_s = sum(r.tokens for r in later) / seconds if seconds > 0 else 0.0
    failures = []
    if len(losses) != len(ref_losses) or not all(math.isfinite(x) for x in losses):
        failures.append(f"losses {losses} against the reference's {ref_losses}")
    if loss_err > tol:
        failures.append(f"a step's loss is {loss_err:.2e} (relative) off the reference's > {tol}")
    if args.precision == "fp32" and param_err > PARAM_TOLERANCE:
        failures.append(f"a trained tensor is {param_err:.2e} off the reference's > 1e-5")
    failures += [f"replicas apart: {line}" for line in apart[:10]]
    audited, audit_difference = audits(registry)
    if audited.get("caught") or audited.get("undecided"):
        failures.append(f"an audit found honest replicas apart past its tolerance: {audited}")
    if args.quick and not audited.get("agreed"):
        failures.append(f"every microbatch was to be audited, yet no audit agreed: {audited}")
    result: dict[str, Any] = {
        "device": args.device,
        "precision": args.precision,
        "steps": len(losses),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "loss_rel_err": loss_err,
        "param_rel_err": param_err,
        "param_worst": worst,
        "replicas_bitwise_equal": not apart,
        "audits": audited,
        "audit_max_difference": audit_difference,
        "tokens_per_s": tokens_s,
        "reference_s": reference_s,
        "device_peak_bytes": peaks,
        "peak_rss_bytes": rss,
        "failures": failures,
    }
    mib = 1 << 20
    on_device = [p for p in peaks if p is not None]
    memory = (
        ", ".join(
            f"s{i // REPLICAS}r{i % REPLICAS} {p / mib:.0f} MiB" for i, p in enumerate(on_device)
        )
        if len(on_device) == len(peaks)
        else "not CUDA: peak RSS " + ", ".join(f"{p / mib:.0f} MiB" for p in rss)
    )
    print(
        f"{args.precision} on {args.device}, {STAGES} stages x {REPLICAS} replicas, "
        f"{len(losses)} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}; largest relative "
        f"error against the CPU reference: loss {loss_err:.2e}, parameters {param_err:.2e} "
        f"({worst}); replicas of each stage bitwise equal: {'yes' if not apart else 'NO'}; "
        f"audits {audited.get('agreed', 0)} agreed (largest difference {audit_difference:.1e}), "
        f"{audited.get('undecided', 0) + audited.get('caught', 0)} apart; "
        f"{tokens_s:.0f} tokens/s; device memory per server (max_memory_allocated): {memory}"
    )
    for failure in failures:
        print(f"FAIL: {failure}")
    if not failures:
        shutil.rmtree(work, ignore_errors=True)  # the logs of a failed run stay
    print("RESULT " + json.dumps(result), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
