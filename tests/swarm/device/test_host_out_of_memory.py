"""An allocation that fails in host memory (torch's CPU allocator, Python's MemoryError) is out of
memory like a device's (`swarm.device.oom.is_out_of_memory`): a CPU peer's Forward or
Backward answers OutOfDeviceMemory (replayed elsewhere), not INTERNAL; and a round's member whose
sum cannot be allocated is named by the others, so the coordinator retries without it."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import torch

from stage_server.averaging.owner import AveragingAborted
from stage_server.replica.runtime import StageRuntime
from swarm.device.oom import OutOfDeviceMemory, is_out_of_memory, out_of_memory
from swarm.wire.crossing import Crossing
from tests.support.jobs import make_job
from tests.support.pools import fail_in_round, reduce_all, replicas

ABSURD = 1 << 60  # bytes no machine has: the allocator refuses at once, touching nothing


def _allocate_too_much(*_: object) -> torch.Tensor:
    return torch.empty(ABSURD, dtype=torch.uint8)


def _cpu_allocation_failure() -> RuntimeError:
    try:
        torch.empty(ABSURD, dtype=torch.uint8)
    except RuntimeError as e:
        return e
    raise AssertionError("an allocation of 2**60 bytes succeeded")


def test_what_a_failed_allocation_raises_is_out_of_memory() -> None:
    failed = _cpu_allocation_failure()  # "DefaultCPUAllocator: can't allocate memory: ..."
    assert is_out_of_memory(failed), repr(failed)
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(OSError(errno.ENOMEM, "Cannot allocate memory"))
    assert is_out_of_memory(out_of_memory("CUDA out of memory. Tried to allocate 2.00 GiB"))
    for other in (
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"),
        ValueError("out of range"),
        OSError(errno.ENOENT, "No such file or directory"),
    ):
        assert not is_out_of_memory(other), repr(other)


@pytest.mark.parametrize("computation", ["Forward", "Backward"])
def test_a_cpu_allocation_failing_in_a_computation_answers_out_of_device_memory(
    tmp_path: Path, computation: str
) -> None:
    job = make_job(tmp_path)
    rt = StageRuntime(job, 1)
    x = torch.randn(4, 16, 32, dtype=torch.float64)
    block = next(m for m in rt.module.modules() if isinstance(m, torch.nn.Linear))

    def allocate(*_: Any) -> None:
        torch.empty(ABSURD, dtype=torch.uint8)  # as a too large microbatch would on this host

    if computation == "Forward":
        block.register_forward_hook(allocate)
        call: Any = lambda: rt.forward(0, 0, Crossing(x))  # noqa: E731
    else:
        block.register_full_backward_hook(allocate)  # before the forward, whose graph runs it
        out = rt.forward(0, 0, Crossing(x))
        call = lambda: rt.backward(0, 0, None, torch.ones_like(out))  # noqa: E731
    # Before: the RuntimeError itself, which the servicer answers INTERNAL.
    with pytest.raises(OutOfDeviceMemory, match=f"out of device memory in {computation}"):
        call()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["own part", "owner's sum"])
async def test_a_member_whose_allocation_fails_in_a_round_is_named_by_the_others(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = 1
    async with replicas(3) as pool:
        # a too large part, or sum, on this host
        fail_in_round(monkeypatch, pool[failing].averager, where, _allocate_too_much)
        results = await reduce_all(
            pool, [torch.randn(1001, dtype=torch.float64) for _ in pool], timeout_s=30.0
        )
    for i, result in enumerate(results):
        assert isinstance(result, BaseException), result
        if i == failing and where == "own part":
            # Before: an AveragingAborted naming no one (its own failure read as a refused
            # contribution), which its commit answers as the round's abort: the coordinator
            # retried the same group.
            assert is_out_of_memory(result), repr(result)
        else:
            assert isinstance(result, AveragingAborted), repr(result)
            if i != failing:
                assert failing in result.missing, (i, repr(result))
