"""A replica's compute failing mid-way (a CUDA out-of-memory error is an ordinary exception on a
GPU; any exception on the CPU stands in for it): no receipt without its microbatch in the sums,
no sums half added, and the microbatch replayed after the failure adds once, so the committed
step equals the reference's (float64, exactly as the other exactness tests hold it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from stage_server.replica.runtime import StageRuntime
from swarm.device.oom import OutOfDeviceMemory
from swarm.job.config import JobConfig
from swarm.model.data import make_data
from swarm.ops import faults
from swarm.wire.crossing import Crossing
from tests.support.crossing import first_stage
from tests.support.equality import assert_states_within, local_state
from tests.support.jobs import make_job

# The job, the stage, the computation, the microbatch's size and the free memory ("cpu" here).
OOM_SAYS = (
    r"job test stage 0: out of device memory in ForwardBackward of a microbatch of 4 samples "
    r"\(cpu\)"
)


def _job(tmp_path: Path) -> JobConfig:
    return make_job(tmp_path, training={"stages": 1, "steps": 1})


def _raise_after_first_accumulation(rt: StageRuntime) -> None:
    """The next backward raises inside autograd, once one parameter's gradient was added to the
    sums and before the others' were (as an allocation failing half way through would)."""
    handles: list[torch.utils.hooks.RemovableHandle] = []

    def fail(_: torch.Tensor) -> None:
        for h in handles:
            h.remove()
        raise RuntimeError("CUDA out of memory (injected in the test)")

    handles.extend(p.register_post_accumulate_grad_hook(fail) for p in rt.params)


def test_a_backward_that_raises_half_way_leaves_no_receipt_and_a_retry_adds_it_once(
    tmp_path: Path,
) -> None:
    job = _job(tmp_path)
    data, rt = make_data(job), StageRuntime(job, 0)
    m = job.training.microbatches_per_step
    rt.forward_backward(0, 0, *first_stage(data.microbatch(0, 0)))
    _raise_after_first_accumulation(rt)
    with pytest.raises(OutOfDeviceMemory, match=OOM_SAYS):
        rt.forward_backward(0, 1, *first_stage(data.microbatch(0, 1)))
    # Before: the receipt of microbatch 1 stayed (recorded before the backward ran), so the
    # retry below answered duplicate=True and added nothing: the commit applied a gradient
    # without it (or with part of it).
    assert 1 not in rt.receipts()
    for index in range(1, m):  # the failed microbatch replayed here, then the rest
        _, _, receipt = rt.forward_backward(0, index, *first_stage(data.microbatch(0, index)))
        assert not receipt.duplicate
    held = sorted(rt.receipts())
    # Sums that held a half-added microbatch are withdrawn whole (their receipts with them):
    # the coordinator voids them and the step's microbatches are replayed elsewhere; here,
    # as a coordinator would, replay what the replica no longer holds.
    for index in sorted(set(range(m)) - set(held)):
        rt.forward_backward(0, index, *first_stage(data.microbatch(0, index)))
    assert sorted(rt.receipts()) == list(range(m))
    assert rt.commit(0, list(range(m)), m * job.training.microbatch_size) is False
    assert_states_within(rt.state_dict(), local_state(job), tol=1e-12)


@pytest.fixture
def armed() -> Iterator[Callable[[str], list[faults.Fault]]]:
    """Arm this process's faults (`SWARM_FAULTS`' raising points) for one test."""
    yield faults.arm
    faults.arm("")


@pytest.mark.parametrize(
    ("point", "where"),
    [
        ("forward-oom", "stage 0: out of device memory in Forward"),
        ("backward-oom", "stage 2: out of device memory in ForwardBackward"),
    ],
)
def test_the_fault_plan_raises_out_of_memory_once_and_the_replay_is_exact(
    tmp_path: Path, armed: Callable[[str], list[faults.Fault]], point: str, where: str
) -> None:
    """Three stages, the fault armed in this process: the first Forward (stage 0), or the
    first backward once a gradient reached its sums (the last stage's), raises out of memory.
    The trainer replays the microbatch (here, on the same replicas): once, each stage adds it
    once, and the committed step is the reference's."""
    job = make_job(tmp_path, training={"stages": 3, "steps": 1})
    data, runtimes = make_data(job), [StageRuntime(job, k) for k in range(3)]
    m = job.training.microbatches_per_step
    armed(f"{point}@0")
    failed = []
    for index in range(m):
        x, y = data.microbatch(0, index)
        while True:
            try:
                h1 = runtimes[0].forward(0, index, Crossing(x))
                h2 = runtimes[1].forward(0, index, Crossing(h1))
                _, g2, _ = runtimes[2].forward_backward(0, index, Crossing(h2), y)
                assert g2 is not None
                g1, _ = runtimes[1].backward(0, index, None, g2)
                assert g1 is not None
                runtimes[0].backward(0, index, None, g1, need_grad_inputs=False)
                break
            except OutOfDeviceMemory as e:
                failed.append((index, str(e)))
    assert len(failed) == 1, failed  # once
    assert failed[0][0] == 0 and f"job test {where} of a microbatch of 4" in failed[0][1]
    assert f"(cpu): CUDA out of memory (injected: SWARM_FAULTS {point}@0)" in failed[0][1]
    samples = m * job.training.microbatch_size
    for rt in runtimes:
        assert rt.receipts() == dict.fromkeys(range(m), 4)
        assert rt.commit(0, list(range(m)), samples) is False
    state: dict[str, torch.Tensor] = {}
    for rt in runtimes:
        state.update(rt.state_dict())
    assert_states_within(state, local_state(job), tol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_cuda_allocation_failure_mid_backward_leaves_no_receipt_and_replays_exactly(
    tmp_path: Path,
) -> None:
    """The first test on a GPU, with the device's own failure: once the first gradient landed
    in the sums, the process's allocator is capped at what it holds and asked for a new block
    (bench/gpu_fault_check.py's `failing_once`): CUDA's OutOfMemoryError mid-backward. Then the
    same replays, and the float64 step on the device within 1e-10 of the CPU reference."""
    from bench.gpu_fault_check import failing_once

    job = _job(tmp_path)
    data, rt = make_data(job), StageRuntime(job, 0, device="cuda:0")
    m = job.training.microbatches_per_step
    rt.forward_backward(0, 0, *first_stage(data.microbatch(0, 0)))
    lift = failing_once(rt)
    try:
        with pytest.raises(OutOfDeviceMemory, match="Tried to allocate"):
            rt.forward_backward(0, 1, *first_stage(data.microbatch(0, 1)))
    finally:
        lift()
    assert 1 not in rt.receipts()
    for index in range(1, m):
        rt.forward_backward(0, index, *first_stage(data.microbatch(0, index)))
    for index in sorted(set(range(m)) - set(rt.receipts())):
        rt.forward_backward(0, index, *first_stage(data.microbatch(0, index)))
    assert sorted(rt.receipts()) == list(range(m))
    assert rt.commit(0, list(range(m)), m * job.training.microbatch_size) is False
    state = {k: v.cpu() for k, v in rt.state_dict().items()}
    assert_states_within(state, local_state(job), tol=1e-10)
