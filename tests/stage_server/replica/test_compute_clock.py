"""Compute is timed to its completion on the device, not to its launch (issue 41, item 2): a
replica's worker (service times, `--throttle`, `queued_seconds`) and measuring time through the
device's `ComputeClock`; a fake asynchronous device, whose calls return before their work is
done, shows the difference."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from stage_server.replica.speed import measure_stage
from stage_server.replica.worker import Worker
from swarm.device.compute_clock import HOST_CLOCK, CudaClock, clock_for
from tests.support.async_device import FakeAsyncDevice
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(120)

DEVICE_SECONDS = 0.3  # how long the fake device runs each computation after its launch returns


def _launch() -> str:
    """A computation whose call returns at once (its kernels queued, not run)."""
    return "launched"


async def test_the_worker_times_a_call_to_its_completion_not_its_launch() -> None:
    device = FakeAsyncDevice(DEVICE_SECONDS)
    with ThreadPoolExecutor(1) as executor:
        worker = Worker(executor, lambda _: None, clock=device)
        assert await worker.run(_launch) == "launched"
    assert worker.ema_seconds is not None
    assert worker.ema_seconds >= DEVICE_SECONDS, (
        f"a call whose device work took {DEVICE_SECONDS} s was timed {worker.ema_seconds:.6f} s "
        "(its launch)"
    )


async def test_throttle_holds_the_worker_for_the_completed_time() -> None:
    # --throttle 3 stands in for a device 3x slower: the worker is held 3x the computation's
    # time, which is its time on the device, not its launch's.
    device = FakeAsyncDevice(DEVICE_SECONDS)
    with ThreadPoolExecutor(1) as executor:
        worker = Worker(executor, lambda _: None, throttle=3.0, clock=device)
        await worker.run(_launch)
    assert worker.ema_seconds is not None
    assert worker.ema_seconds >= 3 * DEVICE_SECONDS, worker.ema_seconds


async def test_a_call_queued_behind_another_waits_for_its_completion() -> None:
    # Two calls submitted together: the second waits for the first's device work, and its
    # `queued_seconds` (the figure a trainer subtracts from its call's time) says so.
    device = FakeAsyncDevice(DEVICE_SECONDS)
    gate = threading.Event()  # the first call launches once both are queued

    def first() -> str:
        gate.wait(timeout=30)
        return "first"

    with ThreadPoolExecutor(1) as executor:
        worker = Worker(executor, lambda _: None, clock=device)
        one = asyncio.ensure_future(worker.run_queued(first))
        two = asyncio.ensure_future(worker.run_queued(_launch))
        await asyncio.sleep(0)  # both submitted
        gate.set()
        (_, _), (_, queued) = await asyncio.gather(one, two)
    assert queued >= DEVICE_SECONDS, (
        f"the second call waited {queued:.6f} s behind a first whose device work took "
        f"{DEVICE_SECONDS} s"
    )


def test_measuring_times_each_run_to_its_completion(tmp_path: Path) -> None:
    job = make_job(tmp_path, training={"stages": 2})
    device = FakeAsyncDevice(0.05)
    figure = measure_stage(job, 0, torch.device("cpu"), clock=device)
    bound = job.training.microbatch_size / device.seconds
    assert figure <= bound, (
        f"{figure:.1f} samples/s measured on a device taking {device.seconds} s a run: at most "
        f"{bound:.1f}"
    )
    assert device.settled >= 4  # the warm-up and at least three timed runs


def test_each_device_gets_its_clock() -> None:
    assert clock_for("cpu") is HOST_CLOCK
    cuda = clock_for("cuda:1")  # built without touching CUDA: a CPU host can name it
    assert isinstance(cuda, CudaClock) and cuda.device == torch.device("cuda:1")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_on_cuda_the_worker_times_a_call_to_the_end_of_its_kernels() -> None:
    # The real device: a call that queues about a second of matmuls returns in milliseconds.
    # Events recorded around its launches time the kernels on the GPU; the worker's time, from
    # before the call to the settled end, can only be longer.
    device = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(4096, 4096, device=device)
    a.matmul(a)  # cuBLAS set up before the timing (its first call blocks the host)
    torch.cuda.synchronize(device)
    events: list[torch.cuda.Event] = []

    def launch() -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        returned = clock_for(device).now()
        begin.record()
        for _ in range(400):  # ~55 TFLOP: hundreds of ms even on an H100
            a.matmul(a)
        end.record()
        events[:] = [begin, end]
        return clock_for(device).now() - returned

    with ThreadPoolExecutor(1) as executor:
        worker = Worker(executor, lambda _: None, clock=clock_for(device))
        launched = await worker.run(launch)
    kernels = events[0].elapsed_time(events[1]) / 1e3
    assert worker.ema_seconds is not None
    assert worker.ema_seconds >= kernels, (worker.ema_seconds, kernels, launched)
    assert kernels > 5 * launched, (kernels, launched)  # the launch did return early
