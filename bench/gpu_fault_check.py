"""The device-failure claims checked on the device: part of bench/gpu_check.sh.

    python bench/gpu_fault_check.py --device cuda:0 [--steps 2]

A float64 job of 3 stages, each a replica (`StageRuntime`) on `--device` in this process, driven
as a trainer drives them (forward through the stages, the last one's ForwardBackward, backward
through the others; a microbatch that fails is replayed), each step committed; then:

1. float64: the trained parameters against the CPU reference (`swarm local`'s `train_local` on
   the CPU), every tensor within 1e-10 (relative): the device's kernels sum in another order
   than the CPU's, nothing else differs;
2. out of memory mid-backward: the same run, where the last stage's backward of a microbatch,
   once its first gradient landed in the sums, meets an allocation the device refuses for real
   (the process capped at what it holds with `torch.cuda.set_per_process_memory_fraction`, then
   asking for a new block: CUDA's caching allocator raises its own `OutOfMemoryError`). The
   replica must answer `OutOfDeviceMemory`, hold no receipt of a sum it half added, and the
   replayed run must end as run 1 does: against the reference within 1e-10, and bitwise equal
   to run 1's parameters.

On a CPU (`--device cpu`, CI's dry run) there is no allocator to cap: the failure is an injected
out-of-memory error at the same point, and everything else is checked the same way. The last
line is `RESULT {json}`; exit status 1 when a claim fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from stage_server.replica.runtime import StageRuntime  # noqa: E402
from swarm.device.oom import OutOfDeviceMemory, out_of_memory  # noqa: E402
from swarm.job.config import load_job  # noqa: E402
from swarm.job.schema import JobConfig  # noqa: E402
from swarm.model.data import make_data  # noqa: E402
from swarm.model.reference import train_local  # noqa: E402
from swarm.wire.crossing import Crossing  # noqa: E402

STAGES = 3
TOLERANCE = 1e-10  # relative, every trained tensor, float64 on the device against the CPU's
JOB = """name = "gpu-faults"
[model]
kind = "llama"
vocab_size = 64
d_model = 32
n_layers = 2
n_heads = 2
n_kv_heads = 1
seq_len = 16
[data]
kind = "synthetic"
[training]
stages = 3
microbatch_size = 4
target_batch_size = 16
steps = {steps}
seed = 0
dtype = "float64"
[optimizer]
kind = "adamw"
lr = 1e-2
weight_decay = 0.01
"""


def refuse_an_allocation(device: torch.device) -> None:
    """Raise what a real device raises when memory runs out: on CUDA the caching allocator's own
    error, the process capped at what it holds and then asking for a block it has not; on a CPU
    the error injected in its place."""
    if device.type != "cuda":
        raise out_of_memory("CUDA out of memory (injected: a CPU has no allocator to cap)")
    torch.cuda.empty_cache()  # no free cached block left to serve the ask below
    held = torch.cuda.memory_reserved(device)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(max(held, 1) / total, device)
    torch.empty(64 << 20, dtype=torch.uint8, device=device)  # a new 64 MiB block: refused


def failing_once(rt: StageRuntime) -> Callable[[], None]:
    """Arm `rt`'s next backward to fail once its first gradient landed in the sums; returns
    what lifts the cap after (CUDA) and disarms."""
    handles: list[Any] = []

    def fail(_: torch.Tensor) -> None:
        for h in handles:
            h.remove()
        handles.clear()
        refuse_an_allocation(rt.device)

    handles.extend(p.register_post_accumulate_grad_hook(fail) for p in rt.params)

    def lift() -> None:
        for h in handles:
            h.remove()
        if rt.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, rt.device)

    return lift


def train(job: JobConfig, device: str, fail_at: int | None) -> tuple[dict[str, Any], list[str]]:
    """The job trained on `device` as a trainer drives its replicas; with `fail_at`, the last
    stage's backward of that microbatch (step 0) fails once. Its state and what it saw fail."""
    data, runtimes = make_data(job), [StageRuntime(job, k, device=device) for k in range(STAGES)]
    m = job.training.microbatches_per_step
    failed: list[str] = []
    for step in range(job.training.steps):
        for index in range(m):
            x, y = data.microbatch(step, index)
            lift = failing_once(runtimes[-1]) if (step, index) == (0, fail_at) else lambda: None
            while True:
                try:
                    through(runtimes, step, index, x, y)
                    break
                except OutOfDeviceMemory as e:
                    failed.append(str(e))
                    if index in runtimes[-1].receipts(step):  # a receipt of a half-added sum
                        failed.append(f"microbatch {index}'s receipt kept after the failure")
                finally:
                    lift()
            # The sums a failure reached are withdrawn with their receipts: the coordinator
            # replays what they held (here, on the same replicas; a duplicate adds nothing).
            for lost in sorted(set(range(index + 1)) - set(runtimes[-1].receipts(step))):
                through(runtimes, step, lost, *data.microbatch(step, lost))
        samples = m * job.training.microbatch_size
        for rt in runtimes:
            assert rt.commit(step, list(range(m)), samples) is False
    state: dict[str, Any] = {}
    for rt in runtimes:
        state.update({k: v.detach().cpu() for k, v in rt.module.state_dict().items()})
    return state, failed


def through(runtimes: list[StageRuntime], step: int, index: int, x: Any, y: Any) -> None:
    """Microbatch `index` forward through the replicas and back, as a trainer's hops (again, a
    replay: a replica that holds its receipt already adds nothing)."""
    h1 = runtimes[0].forward(step, index, Crossing(x))
    h2 = runtimes[1].forward(step, index, Crossing(h1))
    _, g2, _ = runtimes[2].forward_backward(step, index, Crossing(h2), y)
    assert g2 is not None
    g1, _ = runtimes[1].backward(step, index, None, g2)
    assert g1 is not None
    runtimes[0].backward(step, index, None, g1, need_grad_inputs=False)


def worst(state: dict[str, Any], want: dict[str, Any]) -> tuple[float, str]:
    errs = {
        k: float((state[k].double() - v.double()).norm() / v.double().norm().clamp_min(1e-300))
        for k, v in want.items()
    }
    name = max(errs, key=errs.__getitem__)
    return errs[name], name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cuda:N or cpu")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    path = Path(tempfile.mkdtemp(prefix="swarm-gpu-faults-")) / "job.toml"
    path.write_text(JOB.format(steps=args.steps))
    job = load_job(path)
    want = {k: v.detach() for k, v in train_local(job, "cpu").state_dict().items()}
    clean, none_failed = train(job, args.device, None)
    faulty, failed = train(job, args.device, 1)
    clean_err, clean_worst = worst(clean, want)
    faulty_err, _ = worst(faulty, want)
    apart = [k for k in clean if not torch.equal(clean[k], faulty[k])]
    real = args.device.startswith("cuda")
    failures = []
    if none_failed:
        failures.append(f"the run without a fault failed: {none_failed}")
    if len(failed) != 1 or "out of device memory in ForwardBackward" not in failed[0]:
        failures.append(f"want one OutOfDeviceMemory in the last stage's backward; got {failed}")
    elif real and "Tried to allocate" not in failed[0]:
        failures.append(f"not the CUDA allocator's own error: {failed[0]}")
    if clean_err > TOLERANCE:
        failures.append(f"float64 on {args.device}: {clean_worst} {clean_err:.2e} off > 1e-10")
    if faulty_err > TOLERANCE or apart:
        failures.append(f"after the failure: {faulty_err:.2e} off; not bitwise run 1's: {apart}")
    result = {
        "device": args.device,
        "failure": "real allocation failure (capped allocator)" if real else "injected (cpu)",
        "error": failed[0][:300] if failed else None,
        "float64_rel_err": clean_err,
        "after_failure_rel_err": faulty_err,
        "bitwise_as_without": not apart,
        "failures": failures,
    }
    print(
        f"{STAGES} stages float64 on {args.device}, {args.steps} steps: against the CPU "
        f"reference {clean_err:.2e} ({clean_worst}); out of memory mid-backward "
        f"({result['failure']}) then replayed: {faulty_err:.2e}, bitwise the run without it: "
        f"{'yes' if not apart else 'NO'}"
    )
    for failure in failures:
        print(f"FAIL: {failure}")
    print("RESULT " + json.dumps(result), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
