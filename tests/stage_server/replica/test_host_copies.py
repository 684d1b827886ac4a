"""Copies between a replica's device and the host (`swarm.device.host_copies`): the pinned
pool is reused and bounded, the copies are exact, `codec.encode` copies through the seam, and the
worker makes the copy on its own thread, outside the compute's timing (`Worker.run_then`)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from stage_server.replica.worker import Worker
from swarm.device.host_copies import PinnedPool, TorchHostCopies
from swarm.wire import codec
from tests.support.slow_copies import SlowCopies

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _plain(nbytes: int) -> torch.Tensor:  # page-locking needs CUDA: the pool's logic does not
    return torch.empty(nbytes, dtype=torch.uint8)


def test_the_pool_lends_a_buffer_again_once_given_back() -> None:
    pool = PinnedPool(max_bytes=1 << 20, alloc=_plain)
    a = pool.take(10_000)
    assert a is not None and a.numel() >= 10_000
    pool.give(a)
    b = pool.take(9_000)  # the same power-of-two size: the same buffer
    assert b is not None and b.data_ptr() == a.data_ptr()
    assert pool.made == 1


def test_the_pool_never_holds_more_than_its_bound() -> None:
    pool = PinnedPool(max_bytes=64 << 10, alloc=_plain)
    lent = pool.take(40 << 10)  # 64 KiB bucket: the whole bound
    assert lent is not None
    assert pool.take(1) is None  # past the bound: the caller copies without one
    pool.give(lent)
    small = pool.take(8 << 10)  # the kept 64 KiB buffer gives way to a smaller size
    assert small is not None and small.numel() == 8 << 10
    assert pool.allocated == 8 << 10 <= pool.max_bytes


def test_a_host_that_will_not_page_lock_gets_no_buffer_and_the_pool_stays_balanced() -> None:
    def refuse(nbytes: int) -> torch.Tensor:
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    pool = PinnedPool(max_bytes=1 << 20, alloc=refuse)
    assert pool.take(1000) is None
    assert pool.allocated == 0


def test_on_the_cpu_nothing_is_copied_or_page_locked() -> None:
    copies = TorchHostCopies(PinnedPool(alloc=_plain))
    t = torch.randn(3, 5)
    with copies.to_host(t) as host:
        assert host.data_ptr() == t.data_ptr()
    assert copies.to_device(t, torch.device("cpu")) is t
    assert copies.pool.made == 0


@pytest.mark.parametrize("name", sorted(codec.CODECS))
def test_encode_copies_through_the_seam_and_is_exact(name: str) -> None:
    t = torch.randn(4, 33, dtype=torch.float32)
    slow = SlowCopies(seconds=0.0)
    via_seam = codec.encode(t, "x", codec.CODECS[name], 16, host=slow.to_host)
    assert via_seam == codec.encode(t, "x", codec.CODECS[name], 16)
    assert slow.copies == [True]


async def test_the_worker_copies_on_its_thread_outside_the_computes_time() -> None:
    with ThreadPoolExecutor(1, thread_name_prefix="worker") as pool:
        worker = Worker(pool, lambda _: None)
        seen: list[str] = []

        def copy(result: int) -> int:
            seen.append(threading.current_thread().name)
            time.sleep(0.3)  # a slow copy: not the compute's time
            return result + 1

        result, _ = await worker.run_then(lambda x: x * 2, copy, 20)
    assert result == 41
    assert seen and seen[0].startswith("worker")
    assert worker.ema_seconds is not None and worker.ema_seconds < 0.3


@cuda
def test_a_cuda_tensor_reaches_the_host_exactly_through_a_reused_pinned_buffer() -> None:
    copies = TorchHostCopies(PinnedPool(max_bytes=1 << 24))
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        t = (torch.randn(7, 129, device="cuda") * 100).to(dtype)
        with copies.to_host(t) as host:
            assert host.is_pinned() and host.device.type == "cpu"
            assert torch.equal(host, t.cpu())
    with copies.to_host(torch.randn(7, 129, device="cuda")):
        pass
    assert copies.pool.made <= 3  # sizes shared across dtypes: buffers reused, not made anew


@cuda
def test_a_host_tensor_reaches_the_device_exactly() -> None:
    copies = TorchHostCopies(PinnedPool(max_bytes=1 << 24))
    t = torch.randn(64, 257)
    for _ in range(3):
        on = copies.to_device(t, torch.device("cuda"))
        assert on.device.type == "cuda" and torch.equal(on.cpu(), t)
    assert copies.pool.made == 1


@cuda
def test_encode_of_a_cuda_tensor_through_pinned_buffers_equals_the_plain_copy() -> None:
    copies = TorchHostCopies(PinnedPool(max_bytes=1 << 24))
    t = torch.randn(8, 1000, device="cuda")
    for name, value in codec.CODECS.items():
        assert codec.encode(t, "x", value, host=copies.to_host) == codec.encode(t, "x", value), name


@cuda
def test_copies_run_on_their_own_stream_after_the_kernels_that_wrote_them() -> None:
    """A copy to the host waits for the compute stream's kernels that wrote its tensor (a long
    matmul queued just before), and a copy to the device is complete for the compute stream
    that reads it next: both on the copies' stream, not the compute one."""
    copies, device = TorchHostCopies(PinnedPool(max_bytes=1 << 26)), torch.device("cuda:0")
    stream = copies.stream(device)
    assert stream != torch.cuda.current_stream(device) and copies.stream(device) is stream
    a = torch.randn(2048, 2048, device=device)
    for _ in range(3):
        t = a @ a  # queued on the compute stream, not done yet when the copy is asked
        with copies.to_host(t) as host:
            assert torch.equal(host, t.cpu())
        x = torch.randn(512, 513)
        on = copies.to_device(x, device)
        assert torch.equal((on * 2).cpu(), x * 2)  # read by the compute stream
