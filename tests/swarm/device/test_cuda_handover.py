"""The CUDA handover (`swarm.device.cuda_handover`) between two real processes on one device (CUDA
IPC does not open a process's own allocation): a payload offered from inside a larger allocation
is taken as the receiver's own copy, which outlives the sender; a slot of the receiver's is
filled by the other process; a share nobody mapped stays allocated (torch's limbo) unless its
maker gives its receiver count back (`Offer.unused`). Runs where CUDA is (the device check's
tests part); the same logic on a CPU: tests/swarm/device/test_cuda_handover_logic.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from swarm.proto import tensor_pb2

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

N, AT = 1000, 7  # the payload: N bytes at AT within a larger allocation

SENDER = f"""
import sys, torch
from swarm.proto import tensor_pb2
from swarm.device.cuda_handover import CudaHandover
h = CudaHandover(torch.device("cuda", 0))
block = (torch.arange(1 << 20, device="cuda:0") % 251).to(torch.uint8)
offer = h.offer(block[{AT}:{AT} + {N}])
print(offer.handle.SerializeToString().hex(), flush=True)
slot = tensor_pb2.Handover.FromString(bytes.fromhex(sys.stdin.readline().strip()))
print("filled" if h.fill(slot, block[:{N}].flip(0).contiguous()) else "refused", flush=True)
sys.stdin.readline()  # held until the receiver is done
"""


def expected(at: int) -> torch.Tensor:
    return (torch.arange(1 << 20) % 251).to(torch.uint8)[at : at + N]


def test_cuda_handover_between_two_processes_on_one_device() -> None:
    from swarm.device.cuda_handover import CudaHandover

    h = CudaHandover(torch.device("cuda", 0))
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert sender.stdin is not None and sender.stdout is not None
    try:
        handle = tensor_pb2.Handover.FromString(bytes.fromhex(sender.stdout.readline().strip()))
        taken = h.take(handle, N)
        assert taken.device == torch.device("cuda", 0)
        assert torch.equal(taken.cpu(), expected(AT))
        slot = h.slot(N)
        sender.stdin.write(slot.handle.SerializeToString().hex() + "\n")
        sender.stdin.flush()
        assert sender.stdout.readline().strip() == "filled"
        assert torch.equal(slot.read().cpu(), expected(0).flip(0))
        sender.stdin.write("bye\n")
        sender.stdin.flush()
        assert sender.wait(60) == 0
    finally:
        if sender.poll() is None:
            sender.kill()
        sender.communicate()  # reaped, its pipes closed
    # the sender is gone: what was taken is the receiver's own
    assert torch.equal(taken.cpu(), expected(AT))
    slot.release()


def test_cuda_handover_within_one_process_takes_its_own_tensor() -> None:
    from swarm.device.cuda_handover import CudaHandover

    h = CudaHandover(torch.device("cuda", 0))
    block = (torch.arange(1 << 20, device="cuda:0") % 251).to(torch.uint8)
    offer = h.offer(block[AT : AT + N])
    taken = h.take(offer.handle, N)
    block.zero_()  # the taken copy is its own
    assert torch.equal(taken.cpu(), expected(AT))
    slot = h.slot(N)
    assert h.fill(slot.handle, taken)
    assert torch.equal(slot.read().cpu(), expected(AT))
    offer.release()
    slot.release()


@pytest.mark.parametrize("unused", [True, False])
def test_a_share_nobody_mapped_is_freed_once_its_count_is_given_back(unused: bool) -> None:
    # torch keeps a shared block its maker freed while a share still counts on a receiver
    # ("limbo"): for good when nobody maps it, unless its maker gives the count back.
    import gc

    from swarm.device.cuda_handover import CudaHandover

    h = CudaHandover(torch.device("cuda", 0))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(0)
    slot = h.slot(8 << 20)  # a slot nobody fills
    assert torch.cuda.memory_allocated(0) >= before + (8 << 20)
    if unused:
        slot.unused()
    slot.release()
    del slot
    gc.collect()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated(0) - before
    assert (kept < 8 << 20) if unused else (kept >= 8 << 20), kept
